package layer

// cleanups is a stack of steps that undo temporary state (staging trees,
// unpublished image files). A build defers run() first and pushes a step
// after each thing it creates; everything a build stages is temporary, so
// the stack runs on success too, and there is no release. Steps run newest
// first.
type cleanups struct {
	fns []func()
}

func (c *cleanups) push(fn func()) { c.fns = append(c.fns, fn) }

func (c *cleanups) run() {
	for i := len(c.fns) - 1; i >= 0; i-- {
		c.fns[i]()
	}
	c.fns = nil
}
