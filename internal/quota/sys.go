package quota

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// The kernel ABI this package speaks that golang.org/x/sys/unix (v0.50) does
// not define: struct fsxattr and its ioctls (linux/fs.h) and the XFS quota
// manager's quotactl commands and structures (linux/dqblk_xfs.h). Layouts
// were checked against the C headers with sizeof/offsetof; sizes_test.go
// keeps them honest.

// fsxattr is struct fsxattr from linux/fs.h (28 bytes), the argument of
// FS_IOC_FSGETXATTR and FS_IOC_FSSETXATTR.
type fsxattr struct {
	Xflags     uint32  // fsx_xflags: FS_XFLAG_*
	Extsize    uint32  // fsx_extsize: extent size hint
	Nextents   uint32  // fsx_nextents: extent count (get only)
	Projid     uint32  // fsx_projid: project identifier
	Cowextsize uint32  // fsx_cowextsize: CoW extent size hint
	Pad        [8]byte // fsx_pad
}

// fsXflagProjinherit is FS_XFLAG_PROJINHERIT: new children of a directory
// get its project ID (and directories get the flag too).
const fsXflagProjinherit = 0x00000200

// Quota command encoding from linux/quota.h and linux/dqblk_xfs.h.
const (
	prjQuota    = 2 // PRJQUOTA (== XQM_PRJQUOTA)
	subCmdShift = 8 // SUBCMDSHIFT
	subCmdMask  = 0x00ff

	qXGetQuota = 'X'<<8 + 3 // Q_XGETQUOTA: get limits and usage
	qXSetQLim  = 'X'<<8 + 4 // Q_XSETQLIM: set limits
	qXGetQStat = 'X'<<8 + 5 // Q_XGETQSTAT: quota subsystem status
)

// qcmd is QCMD(cmd, type).
func qcmd(cmd, typ uint32) uint32 { return cmd<<subCmdShift | typ&subCmdMask }

// fs_disk_quota constants.
const (
	fsDquotVersion = 1      // FS_DQUOT_VERSION
	fsProjQuota    = 1 << 1 // FS_PROJ_QUOTA (d_flags)

	fsDqISoft = 1 << 0 // FS_DQ_ISOFT (d_fieldmask)
	fsDqIHard = 1 << 1 // FS_DQ_IHARD
	fsDqBSoft = 1 << 2 // FS_DQ_BSOFT
	fsDqBHard = 1 << 3 // FS_DQ_BHARD

	// fs_quota_stat.qs_flags: project quota accounting and enforcement.
	fsQuotaPdqAcct = 1 << 4 // FS_QUOTA_PDQ_ACCT
	fsQuotaPdqEnfd = 1 << 5 // FS_QUOTA_PDQ_ENFD
)

// fsDiskQuota is struct fs_disk_quota from linux/dqblk_xfs.h (112 bytes,
// 64-bit aligned). Block counts and limits are in 512-byte basic blocks
// whatever the filesystem block size.
type fsDiskQuota struct {
	Version      int8    // d_version: FS_DQUOT_VERSION
	Flags        int8    // d_flags: FS_{USER,PROJ,GROUP}_QUOTA
	Fieldmask    uint16  // d_fieldmask: FS_DQ_* fields Q_XSETQLIM changes
	ID           uint32  // d_id: user, project or group ID
	BlkHardlimit uint64  // d_blk_hardlimit: absolute limit on disk blocks (BB)
	BlkSoftlimit uint64  // d_blk_softlimit: preferred limit on disk blocks (BB)
	InoHardlimit uint64  // d_ino_hardlimit: maximum allocated inodes
	InoSoftlimit uint64  // d_ino_softlimit: preferred inode limit
	Bcount       uint64  // d_bcount: disk blocks owned (BB)
	Icount       uint64  // d_icount: inodes owned
	Itimer       int32   // d_itimer: inode grace expiry, 0 within limits
	Btimer       int32   // d_btimer: block grace expiry
	Iwarns       uint16  // d_iwarns: inode warnings issued
	Bwarns       uint16  // d_bwarns: block warnings issued
	ItimerHi     int8    // d_itimer_hi: upper 8 bits of d_itimer
	BtimerHi     int8    // d_btimer_hi
	RtbtimerHi   int8    // d_rtbtimer_hi
	Padding2     int8    // d_padding2
	RtbHardlimit uint64  // d_rtb_hardlimit: realtime blocks limit (BB)
	RtbSoftlimit uint64  // d_rtb_softlimit
	Rtbcount     uint64  // d_rtbcount: realtime blocks owned (BB)
	Rtbtimer     int32   // d_rtbtimer
	Rtbwarns     uint16  // d_rtbwarns
	Padding3     int16   // d_padding3
	Padding4     [8]byte // d_padding4
}

// fsQfilestat is struct fs_qfilestat (24 bytes with tail padding).
type fsQfilestat struct {
	Ino      uint64 // qfs_ino
	Nblks    uint64 // qfs_nblks
	Nextents uint32 // qfs_nextents
}

// fsQuotaStat is struct fs_quota_stat (80 bytes), the Q_XGETQSTAT result.
// Go inserts the same padding as C: one byte before Flags, three before
// Uquota, four at the end.
type fsQuotaStat struct {
	Version      int8        // qs_version
	Flags        uint16      // qs_flags: FS_QUOTA_{U,G,P}DQ_{ACCT,ENFD}
	Pad          int8        // qs_pad
	Uquota       fsQfilestat // qs_uquota
	Gquota       fsQfilestat // qs_gquota
	Incoredqs    uint32      // qs_incoredqs
	Btimelimit   int32       // qs_btimelimit
	Itimelimit   int32       // qs_itimelimit
	Rtbtimelimit int32       // qs_rtbtimelimit
	Bwarnlimit   uint16      // qs_bwarnlimit
	Iwarnlimit   uint16      // qs_iwarnlimit
}

func getFsxattr(fd int) (fsxattr, error) {
	var fa fsxattr
	if err := ioctlPtr(fd, fsIocFsgetxattr, unsafe.Pointer(&fa)); err != nil {
		return fsxattr{}, err
	}
	return fa, nil
}

func setFsxattr(fd int, fa *fsxattr) error {
	return ioctlPtr(fd, fsIocFssetxattr, unsafe.Pointer(fa))
}

func ioctlPtr(fd int, req uintptr, arg unsafe.Pointer) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if errno != 0 {
		return errno
	}
	return nil
}

// quotactlFd is quotactl_fd(2) (Linux 5.14): the filesystem is named by any
// open file on it, so no block device node has to exist in this mount
// namespace.
func quotactlFd(fd int, cmd, id uint32, addr unsafe.Pointer) error {
	_, _, errno := unix.Syscall6(unix.SYS_QUOTACTL_FD, uintptr(fd), uintptr(cmd), uintptr(id), uintptr(addr), 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// quotactlDev is quotactl(2) on a block device path, for kernels before
// quotactl_fd.
func quotactlDev(dev string, cmd, id uint32, addr unsafe.Pointer) error {
	p, err := unix.BytePtrFromString(dev)
	if err != nil {
		return err
	}
	_, _, errno := unix.Syscall6(unix.SYS_QUOTACTL, uintptr(cmd), uintptr(unsafe.Pointer(p)), uintptr(id), uintptr(addr), 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}
