package remote

import (
	"context"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Collector exports the node's layer daemon's figures (GET /stats) as
// Prometheus metrics of the edge, read at each scrape. A node whose
// daemon is not running exports none. Counters restart from zero with
// the daemon.
type Collector struct {
	src *Source

	fetched, requests, errors, seconds, hits, misses, bad, fraction, size, metaReads, metaBytes, packBad, readBytes *prometheus.Desc
	cacheBytes, cacheMax, mounted                                                                                   *prometheus.Desc
}

// NewCollector returns a collector of src's daemon.
func NewCollector(src *Source) *Collector {
	l := []string{"digest"}
	d := func(name, help string, labels []string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, labels, nil)
	}
	return &Collector{
		src:        src,
		fetched:    d("dsec_layer_fetched_bytes_total", "Bytes of a registry-backed layer's image fetched from its source.", l),
		requests:   d("dsec_layer_fetch_requests_total", "Range requests made to a layer's source.", l),
		errors:     d("dsec_layer_fetch_errors_total", "Range requests to a layer's source that failed (each try counts).", l),
		seconds:    d("dsec_layer_fetch_seconds_total", "Time spent in range requests to a layer's source (divide by requests for the mean latency).", l),
		hits:       d("dsec_layer_cache_hits_total", "Chunk reads served from the node's chunk cache.", l),
		misses:     d("dsec_layer_cache_misses_total", "Chunk reads the node's chunk cache could not serve.", l),
		bad:        d("dsec_layer_bad_chunks_total", "Chunks the source sent that did not match the layer's index (refused).", l),
		fraction:   d("dsec_layer_read_fraction", "Fraction of a layer's chunks read at least once since the daemon started.", l),
		size:       d("dsec_layer_image_bytes", "Size of a registry-backed layer's image.", l),
		metaReads:  d("dsec_layer_metadata_reads_total", "Reads of a layer's image served from its metadata pack, fetched whole at registration.", l),
		metaBytes:  d("dsec_layer_metadata_bytes", "Size of a layer's metadata pack (0: its artifact has none).", l),
		packBad:    d("dsec_layer_metadata_pack_mismatches_total", "Chunks completed from a layer's metadata pack that failed their digest while the source's bytes passed (the pack is then no longer used).", l),
		readBytes:  d("dsec_layer_read_bytes", "Bytes of a layer's image brought to the node: its metadata pack and the chunks read, what they share once.", l),
		cacheBytes: d("dsec_layer_cache_bytes", "Bytes in the node's chunk cache.", nil),
		cacheMax:   d("dsec_layer_cache_max_bytes", "Bound of the node's chunk cache.", nil),
		mounted:    d("dsec_layer_images_mounted", "Registry-backed layer images mounted on the node.", nil),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.fetched, c.requests, c.errors, c.seconds, c.hits, c.misses, c.bad, c.fraction, c.size, c.metaReads, c.metaBytes,
		c.packBad, c.readBytes, c.cacheBytes, c.cacheMax, c.mounted} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	st, err := c.src.Stats(ctx)
	if err != nil {
		return // no daemon: nothing read on demand on this node now
	}
	g := prometheus.GaugeValue
	k := prometheus.CounterValue
	ch <- prometheus.MustNewConstMetric(c.cacheBytes, g, float64(st.CacheBytes))
	ch <- prometheus.MustNewConstMetric(c.cacheMax, g, float64(st.CacheMaxBytes))
	ch <- prometheus.MustNewConstMetric(c.mounted, g, float64(st.OpenImages))
	for _, l := range st.Layers {
		ch <- prometheus.MustNewConstMetric(c.fetched, k, float64(l.BytesFetched), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.requests, k, float64(l.Requests), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.errors, k, float64(l.FetchErrors), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.seconds, k, l.FetchSeconds, l.Digest)
		ch <- prometheus.MustNewConstMetric(c.hits, k, float64(l.CacheHits), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.misses, k, float64(l.CacheMisses), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.bad, k, float64(l.BadChunks), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.fraction, g, l.ReadFraction, l.Digest)
		ch <- prometheus.MustNewConstMetric(c.size, g, float64(l.SizeBytes), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.metaReads, k, float64(l.MetaReads), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.metaBytes, g, float64(l.MetaBytes), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.packBad, k, float64(l.PackMismatches), l.Digest)
		ch <- prometheus.MustNewConstMetric(c.readBytes, g, float64(l.ReadBytes), l.Digest)
	}
}
