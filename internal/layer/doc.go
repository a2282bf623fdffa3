// Package layer owns dsec's read-only filesystem layers (DESIGN.md §3): the
// content-addressed store of EROFS images and its ref catalog on the control
// plane, the per-node reference-counted mounts of those images on the edge,
// and the overlayfs composition that gives each sandbox its own writable
// upper over a stack of shared lowers.
//
// The three parts are independent and may be imported separately:
//
//   - Store (control plane) builds an image from a directory or a tar with
//     mkfs.erofs, names it by the sha256 of the image file, and records
//     "kind/name:tag" → api.Layer in the "layers" bucket of a store.Store.
//     Blobs live at <dir>/blobs/sha256/<hex>.erofs; builds stage under
//     <dir>/staging and leave nothing behind on failure.
//   - Mounter (edge) mounts each image read-only once per node at
//     <mntDir>/<hex> and counts the sandboxes using it.
//   - MountOverlay/UnmountOverlay compose a sandbox root from mounted layers.
//
// Importers: apiserver and cmd/dsec use Store; edge and the sandbox backends
// use Mounter and the overlay functions. Everything that mounts needs root.
package layer
