package cleanup

import (
	"slices"
	"testing"
)

func TestRunIsLIFOAndReleaseForgets(t *testing.T) {
	var got []int
	var s Stack
	s.Add(func() { got = append(got, 1) })
	s.Add(func() { got = append(got, 2) })
	s.Run()
	if !slices.Equal(got, []int{2, 1}) {
		t.Fatalf("got %v, want [2 1]", got)
	}
	s.Run()
	if len(got) != 2 {
		t.Fatalf("second Run re-ran undos: %v", got)
	}
	s.Add(func() { got = append(got, 3) })
	s.Release()
	s.Run()
	if len(got) != 2 {
		t.Fatalf("Release did not forget: %v", got)
	}
}
