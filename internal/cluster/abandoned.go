package cluster

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"time"

	"github.com/dsecproject/dsec/internal/store"
)

// A create whose answer was lost, and whose node then refused its resend
// (the edge was down), is placed on another node. Should the down edge
// come back having made the sandbox before it died, that sandbox belongs
// to nobody: the apiserver records the create's token as abandoned on that
// node first (Abandon), and the edge deletes the sandbox of an abandoned
// token when it starts (before it serves) and every AbandonedSweep after.

// bucketAbandoned holds "NODE/TOKEN" → abandonedRecord.
const bucketAbandoned = "cluster_abandoned"

// AbandonedSweep is how often an edge looks for tokens abandoned on it.
const AbandonedSweep = 10 * time.Second

// abandonedKeep is how long a record is kept for a node that has not come
// back: longer than any TTL a sandbox can have is not needed, since the
// sandbox ends with its TTL anyway.
const abandonedKeep = 7 * 24 * time.Hour

type abandonedRecord struct {
	At time.Time `json:"at"`
}

// Abandon records that the create of token, sent to node, was placed
// elsewhere.
func Abandon(st store.Store, node, token string) error {
	b, _ := json.Marshal(abandonedRecord{At: time.Now().UTC()})
	return st.Put(bucketAbandoned, node+"/"+token, b)
}

// SweepAbandoned hands drop the tokens abandoned on node and forgets those
// it reports handled (their sandbox deleted, or none made), and records
// older than abandonedKeep.
func SweepAbandoned(st store.Store, node string, drop func(tokens []string) (handled []string), log *slog.Logger) error {
	kvs, err := st.List(bucketAbandoned, node+"/")
	if err != nil || len(kvs) == 0 {
		return err
	}
	tokens := make([]string, 0, len(kvs))
	old := map[string]bool{}
	for _, kv := range kvs {
		tok := strings.TrimPrefix(kv.Key, node+"/")
		tokens = append(tokens, tok)
		var r abandonedRecord
		if json.Unmarshal(kv.Value, &r) != nil || time.Since(r.At) > abandonedKeep {
			old[tok] = true
		}
	}
	handled := drop(tokens)
	log.Info("creates abandoned on this node while it was down", "tokens", len(tokens), "handled", len(handled))
	for _, tok := range handled {
		old[tok] = true
	}
	for tok := range old {
		if err := st.Delete(bucketAbandoned, node+"/"+tok); err != nil {
			log.Warn("forgetting an abandoned create", "token", tok, "err", err)
		}
	}
	return nil
}

// SweepAbandonedLoop runs SweepAbandoned every AbandonedSweep until ctx ends.
func SweepAbandonedLoop(ctx context.Context, st store.Store, node string, drop func([]string) []string, log *slog.Logger) {
	t := time.NewTicker(AbandonedSweep)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			if err := SweepAbandoned(st, node, drop, log); err != nil && ctx.Err() == nil {
				log.Warn("looking for abandoned creates", "err", err)
			}
		}
	}
}
