package apiserver

func (s *Server) envdFilesRoutes() {}
