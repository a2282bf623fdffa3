package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"

	"github.com/dsecproject/dsec/internal/cluster"
)

// The manifests and units in deploy/ are checked against the code, so
// that they cannot rot: every document decodes strictly into its
// Kubernetes API type, every dsec command line parses with the real flags
// of its subcommand, and every reference (volume, env var, selector) is
// satisfied.

const deployDir = "../../deploy"

// k8sObject is one decoded document.
type k8sObject struct {
	file, kind, name string
	obj              any
}

func decodeStrict(b []byte, into any) error {
	j, err := yaml.YAMLToJSON(b)
	if err != nil {
		return err
	}
	dec := json.NewDecoder(bytes.NewReader(j))
	dec.DisallowUnknownFields()
	return dec.Decode(into)
}

func loadManifests(t *testing.T) []k8sObject {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(deployDir, "kubernetes", "*.yaml"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no manifests: %v", err)
	}
	var out []k8sObject
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, doc := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(b), -1) {
			if strings.TrimSpace(stripComments(doc)) == "" {
				continue
			}
			var meta struct {
				Kind     string `json:"kind"`
				Metadata struct {
					Name string `json:"name"`
				} `json:"metadata"`
			}
			if err := yaml.Unmarshal([]byte(doc), &meta); err != nil {
				t.Fatalf("%s document %d: %v", f, i, err)
			}
			var obj any
			switch meta.Kind {
			case "Namespace":
				obj = &corev1.Namespace{}
			case "Service":
				obj = &corev1.Service{}
			case "ConfigMap":
				obj = &corev1.ConfigMap{}
			case "PersistentVolumeClaim":
				obj = &corev1.PersistentVolumeClaim{}
			case "Deployment":
				obj = &appsv1.Deployment{}
			case "DaemonSet":
				obj = &appsv1.DaemonSet{}
			case "StatefulSet":
				obj = &appsv1.StatefulSet{}
			default:
				t.Fatalf("%s document %d: kind %q has no check here", f, i, meta.Kind)
			}
			if err := decodeStrict([]byte(doc), obj); err != nil {
				t.Fatalf("%s: %s %s does not decode into the Kubernetes API type: %v", f, meta.Kind, meta.Metadata.Name, err)
			}
			out = append(out, k8sObject{file: filepath.Base(f), kind: meta.Kind, name: meta.Metadata.Name, obj: obj})
		}
	}
	return out
}

func stripComments(s string) string {
	var b strings.Builder
	for _, l := range strings.Split(s, "\n") {
		if !strings.HasPrefix(strings.TrimSpace(l), "#") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// expandK8s replaces $(VAR) with a sample value of the kind the env var
// holds, failing if the container does not define VAR.
func expandK8s(t *testing.T, arg string, env map[string]bool) string {
	t.Helper()
	samples := map[string]string{"NODE_IP": "10.0.0.21", "NODE_NAME": "node21", "POD_NAME": "dsec-etcd-0",
		"DSEC_ETCD": "https://10.0.0.11:2379,https://10.0.0.12:2379", "DSEC_SANDBOX_DENY": "10.244.0.0/16,10.96.0.0/12"}
	return regexp.MustCompile(`\$\(([A-Z_]+)\)`).ReplaceAllStringFunc(arg, func(m string) string {
		name := m[2 : len(m)-1]
		if !env[name] {
			t.Errorf("argument %q uses $(%s), which the container does not define", arg, name)
		}
		v, ok := samples[name]
		if !ok {
			t.Errorf("no sample value for $(%s)", name)
		}
		return v
	})
}

// checkDsecArgs parses a dsec command line with the real flags.
func checkDsecArgs(t *testing.T, where string, args []string) {
	t.Helper()
	if len(args) == 0 {
		t.Errorf("%s: no dsec subcommand", where)
		return
	}
	var err error
	switch args[0] {
	case "server":
		_, _, err = parseServer(args[1:])
	case "edge":
		_, err = parseEdge(args[1:])
	default:
		t.Errorf("%s: dsec %s is not a daemon", where, args[0])
		return
	}
	if err != nil {
		t.Errorf("%s: dsec %s does not accept its arguments: %v", where, strings.Join(args, " "), err)
	}
}

func TestKubernetesManifests(t *testing.T) {
	objs := loadManifests(t)
	configMaps, claims := map[string]bool{}, map[string]bool{}
	podLabels := map[string]map[string]string{}
	seen := map[string]bool{}
	for _, o := range objs {
		seen[o.kind] = true
		switch v := o.obj.(type) {
		case *corev1.ConfigMap:
			configMaps[v.Name] = true
			// etcd as the manifests run it: TLS only.
			if eps, ok := v.Data["DSEC_ETCD"]; ok {
				if secure, err := etcdSecure(splitList(eps), cluster.EtcdTLSFiles{}); err != nil || !secure {
					t.Errorf("%s: DSEC_ETCD %s: TLS %v, %v; want https:// endpoints", o.file, eps, secure, err)
				}
			}
		case *corev1.PersistentVolumeClaim:
			claims[v.Name] = true
		}
	}
	for _, want := range []string{"Namespace", "Deployment", "DaemonSet", "Service", "StatefulSet"} {
		if !seen[want] {
			t.Errorf("no %s in deploy/kubernetes", want)
		}
	}
	checkPod := func(where string, spec corev1.PodSpec, labels map[string]string, selector map[string]string, claimed ...string) {
		for k, v := range selector {
			if labels[k] != v {
				t.Errorf("%s: selector %s=%s does not match the pod's labels %v", where, k, v, labels)
			}
		}
		volumes := map[string]corev1.Volume{}
		for _, name := range claimed {
			volumes[name] = corev1.Volume{Name: name}
		}
		for _, v := range spec.Volumes {
			volumes[v.Name] = v
			if v.PersistentVolumeClaim != nil && !claims[v.PersistentVolumeClaim.ClaimName] {
				t.Errorf("%s: volume %s claims %s, which no manifest makes", where, v.Name, v.PersistentVolumeClaim.ClaimName)
			}
		}
		for _, c := range spec.Containers {
			env := map[string]bool{}
			for _, e := range c.Env {
				env[e.Name] = true
				if r := e.ValueFrom; r != nil && r.ConfigMapKeyRef != nil && !configMaps[r.ConfigMapKeyRef.Name] {
					t.Errorf("%s: env %s reads config map %s, which no manifest makes", where, e.Name, r.ConfigMapKeyRef.Name)
				}
			}
			for _, m := range c.VolumeMounts {
				if _, ok := volumes[m.Name]; !ok {
					t.Errorf("%s: container %s mounts volume %s, which the pod does not have", where, c.Name, m.Name)
				}
			}
			if c.Image == "dsec:latest" {
				var args []string
				for _, a := range c.Args {
					args = append(args, expandK8s(t, a, env))
				}
				checkDsecArgs(t, where, args)
			}
		}
	}
	for _, o := range objs {
		where := o.file + " " + o.kind + " " + o.name
		switch v := o.obj.(type) {
		case *appsv1.Deployment:
			checkPod(where, v.Spec.Template.Spec, v.Spec.Template.Labels, v.Spec.Selector.MatchLabels)
			podLabels[v.Name] = v.Spec.Template.Labels
		case *appsv1.DaemonSet:
			checkPod(where, v.Spec.Template.Spec, v.Spec.Template.Labels, v.Spec.Selector.MatchLabels)
			if !v.Spec.Template.Spec.HostNetwork || v.Spec.Template.Spec.Containers[0].SecurityContext == nil ||
				v.Spec.Template.Spec.Containers[0].SecurityContext.Privileged == nil || !*v.Spec.Template.Spec.Containers[0].SecurityContext.Privileged {
				t.Errorf("%s: the edge needs the host network and a privileged container", where)
			}
			podLabels[v.Name] = v.Spec.Template.Labels
		case *appsv1.StatefulSet:
			var claimed []string
			for _, c := range v.Spec.VolumeClaimTemplates {
				claimed = append(claimed, c.Name)
			}
			checkPod(where, v.Spec.Template.Spec, v.Spec.Template.Labels, v.Spec.Selector.MatchLabels, claimed...)
			podLabels[v.Name] = v.Spec.Template.Labels
		}
	}
	for _, o := range objs {
		svc, ok := o.obj.(*corev1.Service)
		if !ok {
			continue
		}
		matched := false
		for _, labels := range podLabels {
			ok := true
			for k, v := range svc.Spec.Selector {
				if labels[k] != v {
					ok = false
				}
			}
			matched = matched || ok
		}
		if !matched {
			t.Errorf("Service %s selects %v, which no pod template carries", svc.Name, svc.Spec.Selector)
		}
	}
}

// TestSystemdUnits: the units' dsec command lines parse, with the values
// of the example environment file.
func TestSystemdUnits(t *testing.T) {
	env := map[string]string{}
	b, err := os.ReadFile(filepath.Join(deployDir, "systemd", "dsec.env.example"))
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, "="); ok && !strings.HasPrefix(strings.TrimSpace(l), "#") {
			env[k] = v
		}
	}
	for _, unit := range []string{"dsec-server.service", "dsec-edge.service"} {
		f, err := os.Open(filepath.Join(deployDir, "systemd", unit))
		if err != nil {
			t.Fatal(err)
		}
		var exec string
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			l := sc.Text()
			if strings.HasPrefix(l, "ExecStart=") || exec != "" && strings.HasSuffix(exec, "\\") {
				exec = strings.TrimSuffix(exec, "\\") + " " + strings.TrimSpace(strings.TrimPrefix(l, "ExecStart="))
			}
		}
		f.Close()
		fields := strings.Fields(exec)
		if len(fields) < 2 || !strings.HasSuffix(fields[0], "/dsec") {
			t.Fatalf("%s: ExecStart %q does not run dsec", unit, exec)
		}
		var args []string
		for _, a := range fields[1:] {
			args = append(args, regexp.MustCompile(`\$\{([A-Z_]+)\}`).ReplaceAllStringFunc(a, func(m string) string {
				v, ok := env[m[2:len(m)-1]]
				if !ok {
					t.Errorf("%s uses %s, which dsec.env.example does not set", unit, m)
				}
				return v
			}))
		}
		checkDsecArgs(t, unit, args)
	}
}
