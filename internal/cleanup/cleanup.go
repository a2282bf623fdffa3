// Package cleanup is the undo stack used by every multi-step setup: each
// step that creates something pushes its undo; on failure the deferred Run
// undoes everything in reverse; on success Release forgets the stack.
package cleanup

// Stack is a LIFO list of undo functions. The zero value is ready to use.
type Stack struct {
	fns []func()
}

// Add pushes an undo function.
func (s *Stack) Add(fn func()) { s.fns = append(s.fns, fn) }

// Release forgets every pushed function: the setup succeeded.
func (s *Stack) Release() { s.fns = nil }

// Run runs the pushed functions newest first and empties the stack.
func (s *Stack) Run() {
	for i := len(s.fns) - 1; i >= 0; i-- {
		s.fns[i]()
	}
	s.fns = nil
}
