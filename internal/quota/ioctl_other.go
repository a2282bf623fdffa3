//go:build linux && (mips || mipsle || mips64 || mips64le || ppc || ppc64 || ppc64le || sparc64)

package quota

// FS_IOC_FSGETXATTR and FS_IOC_FSSETXATTR in the _IOC encoding of mips,
// powerpc and sparc (read = 2, write = 4, 13 size bits at bit 16).
const (
	fsIocFsgetxattr = 0x401c581f
	fsIocFssetxattr = 0x801c5820
)
