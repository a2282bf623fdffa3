package image

// DefaultGroupBytes is the size up to which consecutive layers are merged
// into one: DSec's figure. Fewer, larger lowers make overlay lookups
// cheaper, while layers above it are worth keeping shared on their own.
const DefaultGroupBytes = 3 << 30

// Group is a run of consecutive layers, [Start, End) by index, to be
// merged into one; Bytes is the sum of their sizes.
type Group struct {
	Start, End int
	Bytes      int64
}

// GroupLayers groups consecutive layers, bottom first, so that each group's
// total size stays at or under threshold (DefaultGroupBytes when threshold
// is not positive). A layer larger than threshold forms a group alone.
// Greedy from the bottom: base layers, which many images share, are grouped
// the same way whatever is stacked above them, so their merged layers dedupe.
func GroupLayers(sizes []int64, threshold int64) []Group {
	if threshold <= 0 {
		threshold = DefaultGroupBytes
	}
	var out []Group
	for i, s := range sizes {
		if s < 0 {
			s = 0
		}
		if n := len(out); n > 0 && out[n-1].Bytes+s <= threshold {
			out[n-1].End = i + 1
			out[n-1].Bytes += s
			continue
		}
		out = append(out, Group{Start: i, End: i + 1, Bytes: s})
	}
	return out
}
