package edge

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics are the edge's Prometheus metrics.
type Metrics struct {
	reg            prometheus.Registerer
	createSeconds  prometheus.Histogram
	execSeconds    prometheus.Histogram
	createFailures *prometheus.CounterVec
	reaped         *prometheus.CounterVec
	pauseSeconds   prometheus.Histogram
	resumeSeconds  prometheus.Histogram
	pauseFreed     prometheus.Histogram
	poolClaims     *prometheus.CounterVec
	strayThaws     prometheus.Counter
	// diskPressurePauses counts the sandboxes the disk guard paused.
	diskPressurePauses prometheus.Counter
}

// NewMetrics creates the edge's metrics and registers them on reg (nil:
// not registered, for tests).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		reg: reg,
		createSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_create_seconds",
			Help:    "Time from admission to a sandbox ready for exec.",
			Buckets: []float64{.005, .01, .015, .025, .05, .1, .25, .5, 1, 2.5, 5, 10},
		}),
		execSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_exec_seconds",
			Help:    "Duration of exec calls and session runs, command time included.",
			Buckets: []float64{.002, .005, .01, .025, .05, .1, .25, .5, 1, 5, 30, 120},
		}),
		createFailures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_sandbox_create_failures_total",
			Help: "Sandbox creations that failed, by reason (API error code).",
		}, []string{"reason"}),
		reaped: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_sandbox_stopped_total",
			Help: "Sandboxes stopped by the edge, by reason (ttl expired, idle timeout, init exited).",
		}, []string{"reason"}),
		pauseSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_pause_seconds",
			Help:    "Time to freeze a sandbox and reclaim its memory.",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1, 5},
		}),
		resumeSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_resume_seconds",
			Help:    "Time to thaw a paused sandbox.",
			Buckets: []float64{.001, .005, .01, .025, .05, .1, .25, .5, 1},
		}),
		poolClaims: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "dsec_pool_claims_total",
			Help: "Creates served from a warm pool (hit) or not (miss), when pools are on.",
		}, []string{"result"}),
		strayThaws: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_sandbox_stray_thaws_total",
			Help: "Running sandboxes found frozen (a pause or snapshot cut short by a crash) and thawed.",
		}),
		diskPressurePauses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "dsec_sandbox_disk_pressure_pauses_total",
			Help: "Sandboxes paused by the node because its state filesystem fell below its floor of free space.",
		}),
		pauseFreed: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "dsec_sandbox_pause_freed_bytes",
			Help:    "Memory given back by reclaim when a sandbox is paused.",
			Buckets: prometheus.ExponentialBuckets(1<<20, 4, 8),
		}),
	}
	if reg != nil {
		reg.MustRegister(m.createSeconds, m.execSeconds, m.createFailures, m.reaped,
			m.pauseSeconds, m.resumeSeconds, m.pauseFreed, m.poolClaims, m.strayThaws, m.diskPressurePauses)
	}
	return m
}

// bind registers the per-state gauge, which reads the edge on scrape.
func (m *Metrics) bind(e *Edge) {
	if m.reg == nil {
		return
	}
	m.reg.MustRegister(&stateCollector{e: e, desc: prometheus.NewDesc(
		"dsec_sandboxes", "Sandboxes on this node by state.", []string{"state", "backend"}, nil)})
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "dsec_cgroup_slots_free",
		Help: "Emptied sandbox cgroups kept for the next sandboxes (--cgroup-pool).",
	}, func() float64 { return float64(e.freeCgroupSlots()) }))
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "dsec_sessions_open",
		Help: "Sessions open on this node (bounded by --max-sessions-total).",
	}, func() float64 { return float64(e.sessions.inUse()) }))
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "dsec_streams_open",
		Help: "Commands, port connections and file transfers running on this node (bounded by --max-streams).",
	}, func() float64 { return float64(e.streams.inUse()) }))
}

type stateCollector struct {
	e    *Edge
	desc *prometheus.Desc
}

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	counts := c.e.countsByBackend()
	for _, b := range c.e.backends() {
		for _, st := range []string{"creating", "running", "paused", "stopped", "failed"} {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(counts[[2]string{b.Name(), st}]), st, b.Name())
		}
	}
}
