package apiserver

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the apiserver's own series (the edge's are its own).
type metrics struct {
	requests       *prometheus.CounterVec
	placements     *prometheus.CounterVec
	placeRetries   prometheus.Counter
	forwardSeconds prometheus.Histogram
}

func newMetrics(reg prometheus.Registerer, nodes Nodes) *metrics {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_api_requests_total", Help: "API requests by route and status code.",
		}, []string{"route", "code"}),
		placements: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_placements_total", Help: "Placement decisions by outcome (placed, refused: the edge said no, unreachable, resent: sent to its node again after a lost answer, none: no eligible node).",
		}, []string{"result"}),
		placeRetries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_placement_retries_total", Help: "Creates retried on another node after one refused or could not be reached.",
		}),
		forwardSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "dsec_forward_seconds", Help: "Time of per-sandbox calls forwarded to their edge (one-shot calls; streams excluded).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}),
	}
	if reg == nil {
		return m
	}
	reg.MustRegister(m.requests, m.placements, m.placeRetries, m.forwardSeconds)
	if nodes != nil {
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "dsec_watcher_view_age_seconds", Help: "Age of the oldest good poll in the watcher's view of the nodes (0 with no nodes).",
		}, func() float64 {
			oldest := 0.0
			for _, v := range nodes.Snapshot() {
				if v.LastSeen == nil {
					continue
				}
				if a := time.Since(*v.LastSeen).Seconds(); a > oldest {
					oldest = a
				}
			}
			return oldest
		}))
		reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "dsec_nodes_healthy", Help: "Nodes the watcher counts as healthy.",
		}, func() float64 {
			n := 0
			for _, v := range nodes.Snapshot() {
				if v.Healthy {
					n++
				}
			}
			return float64(n)
		}))
	}
	return m
}
