package apiserver

import (
	"os/exec"
	"strings"
	"testing"
)

// TestNoEdgeImports: the apiserver reaches edges only through the
// internal API's interface (edgeapi), so that an apiserver process never
// links the node daemon, its backends or its host setup.
func TestNoEdgeImports(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("needs the go command to list imports")
	}
	out, err := exec.Command(goBin, "list", "-deps", "-f", "{{.ImportPath}}", ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	const mod = "github.com/dsecproject/dsec/internal/"
	for _, dep := range strings.Fields(string(out)) {
		for _, banned := range []string{"edge", "sandbox/container", "cgroup", "netpolicy", "quota"} {
			if dep == mod+banned || strings.HasPrefix(dep, mod+banned+"/") {
				t.Errorf("apiserver imports %s", dep)
			}
		}
	}
}
