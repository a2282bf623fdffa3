package main

import (
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"testing"
)

// Credentials are looked up by the registry host a reference names: a
// layer source's HOST:PORT, and Docker Hub for an image reference whose
// first part has no dot or port.
func TestCredentialsOfALayerSource(t *testing.T) {
	cfg := filepath.Join(t.TempDir(), "config.json")
	auth := base64.StdEncoding.EncodeToString([]byte("alice:pw"))
	if err := os.WriteFile(cfg, []byte(fmt.Sprintf(`{"auths":{"reghost:5000":{"auth":%q},"https://index.docker.io/v1/":{"auth":%q}}}`,
		auth, base64.StdEncoding.EncodeToString([]byte("hub:hubpw")))), 0o600); err != nil {
		t.Fatal(err)
	}
	empty, no := "", false
	c := credFlags{username: &empty, dockerConfig: &cfg, passwordStdin: &no}
	u, p, err := c.resolve("layer add", "oci://reghost:5000/layers/x:1")
	if err != nil || u != "alice" || p != "pw" {
		t.Errorf("oci://reghost:5000: %q %q %v", u, p, err)
	}
	u, _, err = c.resolve("image pull", "reghost/layers/x:1")
	if err != nil || u != "hub" {
		t.Errorf("an image reference without a dot is Docker Hub's: %q %v", u, err)
	}
}
