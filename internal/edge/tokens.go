package edge

import (
	"context"
	"errors"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/edgeapi"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// A create may carry a token (edgeapi.CreateRequest.Token): the node makes
// one sandbox per token, so a create sent again after its answer was lost
// (by the apiserver's HTTP transport when a kept-alive connection died, or
// by the apiserver itself) makes no second sandbox.
//
// e.tokens (under e.tokMu, which is taken under e.mu and s.mu and takes
// nothing itself: creates never hold the edge's main lock for it) maps a
// token to its create: one under way (no id
// yet), or one that made a sandbox still listed here. Sandboxes adopted at
// start-up bring their tokens back from their records.

type tokenEntry struct {
	done chan struct{} // closed when the first create of the token ends
	id   string        // the sandbox it made ("" while under way, or failed)
}

// createOnce runs create unless a create with req's token runs or made a
// sandbox: it then waits for that one and answers its sandbox as it is now.
// A repeat of a create that failed tries again (a failed create leaves
// nothing behind).
func (e *Edge) createOnce(ctx context.Context, req edgeapi.CreateRequest, create func() (*api.Sandbox, error)) (*api.Sandbox, error) {
	tok := req.Token
	if tok == "" {
		return create()
	}
	if len(tok) > edgeapi.MaxTokenLen {
		return nil, errdefs.Invalid("create token of %d bytes; at most %d", len(tok), edgeapi.MaxTokenLen)
	}
	for {
		e.tokMu.Lock()
		t := e.tokens[tok]
		if t == nil {
			t = &tokenEntry{done: make(chan struct{})}
			e.tokens[tok] = t
			e.tokMu.Unlock()
			sb, err := create()
			e.tokMu.Lock()
			if err == nil {
				t.id = sb.ID
			} else if e.tokens[tok] == t {
				delete(e.tokens, tok)
			}
			e.tokMu.Unlock()
			close(t.done)
			return sb, err
		}
		e.tokMu.Unlock()
		select {
		case <-t.done:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		e.tokMu.Lock()
		id := t.id
		e.tokMu.Unlock()
		if id == "" {
			continue // it failed: this one tries
		}
		e.log.Info("a create was sent again: answering the sandbox it made", "sandbox_id", id)
		return e.Get(ctx, id)
	}
}

// noteTokenLocked remembers the token of a sandbox being listed (e.mu and
// s.mu held): one adopted at start-up, whose create is long over.
func (e *Edge) noteTokenLocked(s *sbx) {
	tok := s.rec.Token
	if tok == "" {
		return
	}
	e.tokMu.Lock()
	defer e.tokMu.Unlock()
	if e.tokens[tok] != nil {
		return
	}
	done := make(chan struct{})
	close(done)
	e.tokens[tok] = &tokenEntry{done: done, id: s.rec.Sandbox.ID}
}

// forgetTokenLocked drops the token of a sandbox being unlisted (e.mu and
// s.mu held); a create of it under way keeps its own.
func (e *Edge) forgetTokenLocked(s *sbx) {
	if s.rec.Token == "" {
		return
	}
	e.tokMu.Lock()
	defer e.tokMu.Unlock()
	if t := e.tokens[s.rec.Token]; t != nil && t.id == s.rec.Sandbox.ID {
		delete(e.tokens, s.rec.Token)
	}
}

// DropAbandoned deletes the sandboxes made for tokens whose creates were
// placed on another node while this one was down (cluster.Abandon), and
// returns the tokens it is done with: those whose sandbox is deleted, and
// those it never made. A create of one still under way is left for the
// next call.
func (e *Edge) DropAbandoned(ctx context.Context, tokens []string) (handled []string) {
	for _, tok := range tokens {
		e.tokMu.Lock()
		t := e.tokens[tok]
		e.tokMu.Unlock()
		if t == nil {
			handled = append(handled, tok)
			continue
		}
		select {
		case <-t.done:
		default:
			continue
		}
		e.tokMu.Lock()
		id := t.id
		e.tokMu.Unlock()
		if id == "" {
			handled = append(handled, tok)
			continue
		}
		err := e.Delete(ctx, id)
		if err != nil && !errors.Is(err, errdefs.ErrNotFound) {
			e.log.Warn("deleting the sandbox of an abandoned create", "sandbox_id", id, "err", err)
			continue
		}
		e.log.Warn("deleted a sandbox whose create was placed on another node while this one was down", "sandbox_id", id)
		handled = append(handled, tok)
	}
	return handled
}
