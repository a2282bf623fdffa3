package edgeapi

import "testing"

func TestNodeOf(t *testing.T) {
	for id, want := range map[string]string{
		"sb-local-abc": "local", "sb-node7-x2": "node7", "sb-a-b-c": "a-b",
	} {
		if got, ok := NodeOf(id); !ok || got != want {
			t.Errorf("NodeOf(%q) = %q, %v; want %q", id, got, ok, want)
		}
	}
	for _, bad := range []string{"", "sb-", "sb-x", "xx-local-abc", "sb--abc"} {
		if _, ok := NodeOf(bad); ok {
			t.Errorf("NodeOf(%q) accepted", bad)
		}
	}
}
