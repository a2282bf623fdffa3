package main

import (
	"strings"
	"testing"
	"time"
)

func TestParseLatency(t *testing.T) {
	l, err := parseLatency(defaultHollowLatency)
	if err != nil {
		t.Fatal(err)
	}
	if l.Create.Median != 4900*time.Microsecond || l.Create.P99 != 13700*time.Microsecond || l.Destroy.P99 != 21400*time.Microsecond || l.Resume.Median != 2600*time.Microsecond {
		t.Fatalf("default parsed as %+v", l)
	}
	if l, err := parseLatency("none"); err != nil || l.Create.Median != 0 || l.Exec.P99 != 0 {
		t.Fatalf("none: %+v, %v", l, err)
	}
	for in, mention := range map[string]string{
		"create=5ms":                    "op=MEDIAN/P99",
		"create=5ms/1ms":                "p99",
		"create=-1ms/1ms":               "median",
		"create=x/1ms":                  "median",
		"create=1ms/2ms,create=1ms/3ms": "twice",
		"boot=1ms/2ms":                  "unknown op",
		"create=2m/3m":                  "at most",
		"=1ms/2ms":                      "unknown op",
	} {
		if _, err := parseLatency(in); err == nil || !strings.Contains(err.Error(), mention) {
			t.Errorf("%q: %v, want an error mentioning %q", in, err, mention)
		}
	}
}

func TestCheckHollow(t *testing.T) {
	base := func() edgeCmdConfig {
		var c edgeCmdConfig
		c.node.nodeName = "h"
		c.hollow = hollowConfig{edges: 1, latency: defaultHollowLatency}
		return c
	}
	c := base()
	if err := checkHollow(c); err != nil {
		t.Fatalf("no --hollow: %v", err)
	}
	c.hollow.edges = 3
	if err := checkHollow(c); err == nil || !strings.Contains(err.Error(), "need --hollow") {
		t.Fatalf("--hollow-edges without --hollow: %v", err)
	}
	for _, tc := range []struct {
		edit    func(*edgeCmdConfig)
		mention string
	}{
		{func(c *edgeCmdConfig) { c.hollow.edges = 0 }, "--hollow-edges 0"},
		{func(c *edgeCmdConfig) { c.hollow.edges = maxHollowEdges + 1 }, "--hollow-edges"},
		{func(c *edgeCmdConfig) { c.hollow.latency = "create=1ms" }, "--hollow-latency"},
		{func(c *edgeCmdConfig) { c.node.nodeName = strings.Repeat("a", 39); c.hollow.edges = 10 }, "--node-name"},
		{func(c *edgeCmdConfig) { c.hollow.edges = 2; c.advertise = "10.0.0.1:7000" }, "--advertise"},
	} {
		c := base()
		c.hollow.on = true
		tc.edit(&c)
		if err := checkHollow(c); err == nil || !strings.Contains(err.Error(), tc.mention) {
			t.Errorf("%+v: %v, want an error mentioning %q", c.hollow, err, tc.mention)
		}
	}
	c = base()
	c.hollow.on, c.hollow.edges = true, 160
	if err := checkHollow(c); err != nil {
		t.Fatalf("160 hollow edges: %v", err)
	}
	if hollowName("h", 0, 1) != "h" || hollowName("h", 9, 160) != "h-10" {
		t.Fatal("hollow names")
	}
}
