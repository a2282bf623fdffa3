package apiserver

func (s *Server) e2bControlRoutes() {}
