// Package image turns container images into root filesystem trees that the
// layer store seals into EROFS layers (layer.Store.BuildFromDir). It reads
// OCI image layouts and `docker save` archives from disk (Unpack) and pulls
// from OCI distribution registries over HTTP(S) (Pull); both end in the same
// code, which verifies every blob against its digest and every layer stream
// against the config's diff_ids, selects one platform from multi-arch
// indexes, and applies the layers in order.
//
// Layers come from strangers, so application is confined: every tar entry's
// parent is resolved inside the destination (symlinks planted by earlier
// entries or layers are followed as the image's own filesystem would follow
// them, clamped at its root), the final component is never followed, and
// every directory is reached through openat2 with RESOLVE_IN_ROOT and
// RESOLVE_NO_SYMLINKS, so even a bug in the resolver cannot leave the tree.
// Entries keep their numeric owners, setuid bits, device nodes and a
// whitelist of xattrs (user.* and security.capability), so the destination
// must sit in a directory only root can enter.
//
// Unpack and Pull can split an image: the first layers become a plain tree
// and the rest an overlayfs upper directory over it (whiteouts as 0:0
// character devices, opaque directories as trusted.overlay.opaque="y"), the
// representation layer.ApplyDiff and the sandbox overlays use. GroupLayers
// says where to split or merge.
//
// Importers: cmd/dsec and the apiserver's image import. Applying needs root
// for anything but images owned by the caller's own uid.
package image
