package main

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// stringList is a repeatable string flag (--toolkit A --toolkit B).
type stringList []string

func (l *stringList) String() string { return strings.Join(*l, ",") }

func (l *stringList) Set(s string) error {
	*l = append(*l, s)
	return nil
}

// optBool is a boolean flag that may be left out (nil): --userns sets it
// true, --userns=false false.
type optBool struct{ p **bool }

func (b optBool) String() string {
	if b.p == nil || *b.p == nil {
		return ""
	}
	return strconv.FormatBool(**b.p)
}

func (b optBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return fmt.Errorf("want true or false, got %q", s)
	}
	*b.p = &v
	return nil
}

func (b optBool) IsBoolFlag() bool { return true }

// kvFlag is a repeatable KEY=VALUE flag (--label job=x --env A=b). The value
// may itself contain '='; a repeated key keeps the last value.
type kvFlag map[string]string

func (m kvFlag) String() string { return formatKV(m) }

func (m kvFlag) Set(s string) error {
	k, v, err := parseKV(s)
	if err != nil {
		return err
	}
	m[k] = v
	return nil
}

// parseKV splits "key=value" at the first '='.
func parseKV(s string) (key, value string, err error) {
	k, v, ok := strings.Cut(s, "=")
	if !ok {
		return "", "", fmt.Errorf("%q is not KEY=VALUE", s)
	}
	if k == "" {
		return "", "", fmt.Errorf("%q has an empty key", s)
	}
	return k, v, nil
}

// formatKV renders a map as "a=1,b=2" in key order.
func formatKV(m map[string]string) string {
	var b strings.Builder
	for i, k := range slices.Sorted(maps.Keys(m)) {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(k + "=" + m[k])
	}
	return b.String()
}

// secondsFlag is a duration in whole seconds, as the API counts them. It
// takes a plain number of seconds ("600") or a Go duration ("10m", "1h30m");
// a fraction of a second rounds up.
type secondsFlag int64

func (s *secondsFlag) String() string { return strconv.FormatInt(int64(*s), 10) }

func (s *secondsFlag) Set(v string) error {
	n, err := parseSeconds(v)
	if err != nil {
		return err
	}
	*s = secondsFlag(n)
	return nil
}

func parseSeconds(v string) (int64, error) {
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n < 0 {
			return 0, fmt.Errorf("%q: must not be negative", v)
		}
		return n, nil
	}
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, fmt.Errorf("%q is neither seconds nor a duration like 10m", v)
	}
	if d < 0 {
		return 0, fmt.Errorf("%q: must not be negative", v)
	}
	return int64((d + time.Second - 1) / time.Second), nil
}

// parseFileMode parses octal permission bits ("0644", "755", "4755") into an
// os.FileMode, moving setuid/setgid/sticky into Go's flag bits.
func parseFileMode(s string) (os.FileMode, error) {
	n, err := strconv.ParseUint(s, 8, 32)
	if err != nil || n > 0o7777 {
		return 0, fmt.Errorf("mode %q: want octal permission bits like 0644", s)
	}
	m := os.FileMode(n & 0o777)
	if n&0o4000 != 0 {
		m |= os.ModeSetuid
	}
	if n&0o2000 != 0 {
		m |= os.ModeSetgid
	}
	if n&0o1000 != 0 {
		m |= os.ModeSticky
	}
	return m, nil
}

// humanBytes renders a size in binary units: 0 B, 512 B, 1.5 KiB, 3.0 GiB.
func humanBytes(n int64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := int64(unit), 0
	for m := n / unit; m >= unit && exp < 5; m /= unit {
		div *= unit
		exp++
	}
	return fmt.Sprintf("%.1f %ciB", float64(n)/float64(div), "KMGTPE"[exp])
}

// humanAge renders how long ago t was, coarsely: 45s, 12m, 5h, 3d.
func humanAge(t, now time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := now.Sub(t)
	switch {
	case d < 0:
		return "0s"
	case d < time.Minute:
		return fmt.Sprintf("%ds", int(d/time.Second))
	case d < time.Hour:
		return fmt.Sprintf("%dm", int(d/time.Minute))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d/time.Hour))
	}
	return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
}

// orDash returns s, or "-" for an empty table cell.
func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// kvListFlag is a KEY=VALUE list flag that takes comma-separated pairs and
// may be repeated (--node-labels gpu=a100,zone=b --node-labels pool=cloud).
type kvListFlag map[string]string

func (m kvListFlag) String() string { return formatKV(m) }

func (m kvListFlag) Set(s string) error {
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		k, v, err := parseKV(part)
		if err != nil {
			return err
		}
		m[k] = v
	}
	return nil
}

// splitList splits a comma-separated flag value, dropping empty items.
func splitList(s string) []string {
	var out []string
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p != "" {
			out = append(out, p)
		}
	}
	return out
}
