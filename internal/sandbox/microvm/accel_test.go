package microvm

import (
	"os"
	"path/filepath"
	"testing"
)

// TestDetectAccel: KVM only where a hardware module backs it; PVM's KVM
// (this project's reference machine) and no KVM at all get TCG, each
// with its reason.
func TestDetectAccel(t *testing.T) {
	for _, tc := range []struct {
		name    string
		dev     bool
		modules []string
		want    string
	}{
		{"no device", false, []string{"kvm", "kvm_intel"}, "tcg"},
		{"intel", true, []string{"kvm", "kvm_intel"}, "kvm"},
		{"amd", true, []string{"kvm", "kvm_amd"}, "kvm"},
		{"pvm only", true, []string{"kvm", "kvm_pvm"}, "tcg"},
		{"no module", true, []string{"kvm"}, "tcg"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			dev := filepath.Join(dir, "kvm")
			if tc.dev {
				os.WriteFile(dev, nil, 0o600)
			}
			mods := filepath.Join(dir, "module")
			for _, m := range tc.modules {
				os.MkdirAll(filepath.Join(mods, m), 0o755)
			}
			got, why := DetectAccel(dev, mods)
			if got != tc.want || why == "" {
				t.Fatalf("DetectAccel = %q (%s), want %q", got, why, tc.want)
			}
		})
	}
	got, why := DetectAccel("/dev/kvm", "/sys/module")
	t.Logf("this host: %s (%s)", got, why)
}
