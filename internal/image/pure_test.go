package image

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func TestGroupLayers(t *testing.T) {
	const G = int64(1) << 30
	tests := []struct {
		name      string
		sizes     []int64
		threshold int64
		want      []Group
	}{
		{"none", nil, 0, nil},
		{"one", []int64{5}, 0, []Group{{0, 1, 5}}},
		{"small ones merge", []int64{1 * G, 1 * G, 1 * G, 1 * G}, 0, []Group{{0, 3, 3 * G}, {3, 4, 1 * G}}},
		{"exactly the threshold", []int64{2 * G, 1 * G, 1}, 0, []Group{{0, 2, 3 * G}, {2, 3, 1}}},
		{"big layer alone", []int64{100, 4 * G, 100, 200}, 0, []Group{{0, 1, 100}, {1, 2, 4 * G}, {2, 4, 300}}},
		{"empty layers join", []int64{0, 10, 0, 0}, 0, []Group{{0, 4, 10}}},
		{"custom threshold", []int64{3, 3, 3, 3, 3}, 6, []Group{{0, 2, 6}, {2, 4, 6}, {4, 5, 3}}},
		{"negative sizes count as zero", []int64{-5, 1}, 1, []Group{{0, 2, 1}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := GroupLayers(tc.sizes, tc.threshold); !reflect.DeepEqual(got, tc.want) {
				t.Errorf("GroupLayers(%v, %d) = %v, want %v", tc.sizes, tc.threshold, got, tc.want)
			}
		})
	}
}

func TestParseReference(t *testing.T) {
	dg := "sha256:" + strings.Repeat("ab", 32)
	tests := []struct {
		in   string
		want Reference
		bad  bool
	}{
		{in: "alpine", want: Reference{Registry: "docker.io", Repository: "library/alpine", Tag: "latest"}},
		{in: "alpine:3.20", want: Reference{Registry: "docker.io", Repository: "library/alpine", Tag: "3.20"}},
		{in: "user/app:v1", want: Reference{Registry: "docker.io", Repository: "user/app", Tag: "v1"}},
		{in: "docker.io/alpine:3.20", want: Reference{Registry: "docker.io", Repository: "library/alpine", Tag: "3.20"}},
		{in: "docker.io/user/app", want: Reference{Registry: "docker.io", Repository: "user/app", Tag: "latest"}},
		{in: "ghcr.io/org/app/sub:1.0", want: Reference{Registry: "ghcr.io", Repository: "org/app/sub", Tag: "1.0"}},
		{in: "127.0.0.1:5000/x:y", want: Reference{Registry: "127.0.0.1:5000", Repository: "x", Tag: "y"}},
		{in: "localhost/x", want: Reference{Registry: "localhost", Repository: "x", Tag: "latest"}},
		{in: "localhost:5000/a/b@" + dg, want: Reference{Registry: "localhost:5000", Repository: "a/b", Digest: dg}},
		{in: "r.io/a:t@" + dg, want: Reference{Registry: "r.io", Repository: "a", Tag: "t", Digest: dg}},
		{in: "r.io/my_app__x.y-z", want: Reference{Registry: "r.io", Repository: "my_app__x.y-z", Tag: "latest"}},
		{in: "", bad: true},
		{in: "r.io/../x", bad: true},
		{in: "r.io/a/./b", bad: true},
		{in: "r.io/A", bad: true},
		{in: "r.io/a:b/c", bad: true},
		{in: "r.io/a:", bad: true},
		{in: "r.io/a:.x", bad: true},
		{in: "r.io/a@sha256:../../x", bad: true},
		{in: "r.io/a@md5:abc", bad: true},
		{in: "r.io/a?x=1", bad: true},
		{in: "r.io/a#frag", bad: true},
		{in: "r.io/a%2f..", bad: true},
		{in: "r.io//a", bad: true},
		{in: "r.io/a/", bad: true},
		{in: "a b/c", bad: true},
	}
	for _, tc := range tests {
		got, err := ParseReference(tc.in)
		if tc.bad {
			if err == nil || !isInvalid(err) {
				t.Errorf("ParseReference(%q) = %+v, %v; want an invalid error", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("ParseReference(%q) = %+v, %v; want %+v", tc.in, got, err, tc.want)
		}
	}
	if r, _ := ParseReference("alpine"); r.endpoint() != "registry-1.docker.io" || r.String() != "docker.io/library/alpine:latest" {
		t.Errorf("docker hub: endpoint %s, string %s", r.endpoint(), r.String())
	}
}

func TestCheckDigest(t *testing.T) {
	good := "sha256:" + strings.Repeat("0f", 32)
	if err := checkDigest(good); err != nil {
		t.Errorf("checkDigest(%q) = %v", good, err)
	}
	for _, bad := range []string{"", "sha256:", "sha256:../../x", good + "0", good[:len(good)-1],
		"sha256:" + strings.Repeat("0F", 32), "sha512:" + strings.Repeat("0", 128), strings.TrimPrefix(good, "sha256:"),
		"sha256:" + strings.Repeat("0", 63) + "/", "sha256:" + strings.Repeat("0", 62) + "\x00\x00"} {
		if err := checkDigest(bad); err == nil || !isInvalid(err) {
			t.Errorf("checkDigest(%q) = %v, want invalid", bad, err)
		}
	}
}

func TestParseChallenge(t *testing.T) {
	tests := []struct {
		in     string
		scheme string
		params map[string]string
	}{
		{`Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/alpine:pull"`,
			"Bearer", map[string]string{"realm": "https://auth.docker.io/token", "service": "registry.docker.io", "scope": "repository:library/alpine:pull"}},
		{`Basic realm="Registry Realm"`, "Basic", map[string]string{"realm": "Registry Realm"}},
		{`Bearer realm=https://x/token, service=svc`, "Bearer", map[string]string{"realm": "https://x/token", "service": "svc"}},
		{`Bearer realm="a\"b,c", Scope="s"`, "Bearer", map[string]string{"realm": `a"b,c`, "scope": "s"}},
		{`Basic`, "Basic", map[string]string{}},
	}
	for _, tc := range tests {
		scheme, params := parseChallenge(tc.in)
		if scheme != tc.scheme || !reflect.DeepEqual(params, tc.params) {
			t.Errorf("parseChallenge(%q) = %q %v, want %q %v", tc.in, scheme, params, tc.scheme, tc.params)
		}
	}
}

func TestDockerConfigAuth(t *testing.T) {
	p := filepath.Join(t.TempDir(), "config.json")
	must(t, os.WriteFile(p, []byte(`{"auths":{
		"https://index.docker.io/v1/":{"auth":"aHViOmh1YnB3"},
		"r.example:5000":{"auth":"dTpwOnc="},
		"plain.example":{"username":"pu","password":"pp"},
		"bad.example":{"auth":"!!!"}
	}, "credsStore":"desktop"}`), 0o600))
	tests := []struct{ registry, user, pass string }{
		{"docker.io", "hub", "hubpw"},
		{"r.example:5000", "u", "p:w"},
		{"plain.example", "pu", "pp"},
		{"unknown.example", "", ""},
	}
	for _, tc := range tests {
		u, pw, err := DockerConfigAuth(p, tc.registry)
		if err != nil || u != tc.user || pw != tc.pass {
			t.Errorf("DockerConfigAuth(%s) = %q %q %v, want %q %q", tc.registry, u, pw, err, tc.user, tc.pass)
		}
	}
	if _, _, err := DockerConfigAuth(p, "bad.example"); !isInvalid(err) {
		t.Errorf("bad base64: %v", err)
	}
	if _, _, err := DockerConfigAuth(filepath.Join(t.TempDir(), "missing.json"), "x"); err == nil {
		t.Error("a missing config file was not reported")
	}
}

func TestSelectPlatform(t *testing.T) {
	ms := []descriptor{
		{Digest: "a", Platform: &platform{OS: "linux", Architecture: "arm", Variant: "v7"}},
		{Digest: "att", Platform: &platform{OS: "unknown", Architecture: "unknown"}},
		{Digest: "b", Platform: &platform{OS: "linux", Architecture: "amd64"}},
		{Digest: "c", Platform: &platform{OS: "linux", Architecture: "arm64", Variant: "v8"}},
	}
	for want, digest := range map[string]string{"": "b", "linux/arm64": "c", "linux/arm/v7": "a", "linux/arm64/v8": "c"} {
		p, err := parsePlatform(want)
		must(t, err)
		d, err := selectPlatform(ms, p)
		if err != nil || d.Digest != digest {
			t.Errorf("select %q = %s, %v; want %s", want, d.Digest, err, digest)
		}
	}
	p, _ := parsePlatform("linux/arm/v6")
	_, err := selectPlatform(ms, p)
	if err == nil || !strings.Contains(err.Error(), "linux/arm/v7, linux/amd64, linux/arm64/v8") || strings.Contains(err.Error(), "unknown") {
		t.Errorf("error = %v", err)
	}
}
