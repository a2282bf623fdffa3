package apiserver

func (s *Server) envdProcessRoutes() {}
