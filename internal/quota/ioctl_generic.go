//go:build linux && (386 || amd64 || arm || arm64 || loong64 || riscv64 || s390x)

package quota

// FS_IOC_FSGETXATTR = _IOR('X', 31, struct fsxattr) and FS_IOC_FSSETXATTR =
// _IOW('X', 32, struct fsxattr) in the generic _IOC encoding (read = 2,
// write = 1, 14 size bits at bit 16). x/sys/unix does not define them.
const (
	fsIocFsgetxattr = 0x801c581f
	fsIocFssetxattr = 0x401c5820
)
