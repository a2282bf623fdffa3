package layer

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestExcludesForInclude(t *testing.T) {
	dir := t.TempDir()
	for _, p := range []string{"repo/a", "repo/sub/b", "root/.cache/x", "root/keep", "etc/y", "top"} {
		if err := os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, p), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := ExcludesForInclude(dir, []string{"/repo", "/root/keep"})
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	want := []string{"/etc", "/root/.cache", "/top"}
	if !slices.Equal(got, want) {
		t.Fatalf("excludes = %v, want %v", got, want)
	}
	if got, _ := ExcludesForInclude(dir, []string{"/"}); got != nil {
		t.Fatalf("including / should exclude nothing, got %v", got)
	}
	if _, err := ExcludesForInclude(dir, []string{"repo"}); err == nil {
		t.Fatal("relative include accepted")
	}
	// An include that does not exist leaves nothing but its parents.
	got, _ = ExcludesForInclude(dir, []string{"/nope/x"})
	slices.Sort(got)
	if !slices.Equal(got, []string{"/etc", "/repo", "/root", "/top"}) {
		t.Fatalf("missing include: %v", got)
	}
}
