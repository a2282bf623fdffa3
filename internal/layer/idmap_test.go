package layer

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestNewIDMapNS: a view through the namespace NewIDMapNS makes shows a
// file owned by k on disk as owned by HostID+k, and making one leaves no
// fd or process of its own behind.
func TestNewIDMapNS(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts a tmpfs and makes idmapped mounts")
	}
	src := t.TempDir()
	if err := unix.Mount("tmpfs", src, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(src, unix.MNT_DETACH)
	for name, uid := range map[string]int{"root": 0, "seven": 7, "outside": 70000} {
		if err := os.WriteFile(filepath.Join(src, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(filepath.Join(src, name), uid, uid); err != nil {
			t.Fatal(err)
		}
	}
	fds := func() int {
		ents, err := os.ReadDir("/proc/self/fd")
		if err != nil {
			t.Fatal(err)
		}
		return len(ents)
	}
	before := fds()
	const host = 1_000_131_072
	ns, err := NewIDMapNS(IDMap{HostID: host, Size: 65536})
	if err != nil {
		t.Fatal(err)
	}
	if now := fds(); now != before+1 {
		t.Errorf("%d fds open with the namespace, %d before", now, before)
	}
	view, err := IDMapClone(src, ns)
	ns.Close()
	if err != nil {
		t.Fatal(err)
	}
	defer view.Close()
	for name, want := range map[string]uint32{"root": host, "seven": host + 7, "outside": 65534} {
		var st unix.Stat_t
		if err := unix.Fstatat(int(view.Fd()), name, &st, 0); err != nil {
			t.Fatal(err)
		}
		if st.Uid != want || st.Gid != want {
			t.Errorf("%s is owned by %d:%d through the view, want %d", name, st.Uid, st.Gid, want)
		}
	}
	// The task that made it was reaped: no child of this process is left.
	if _, err := unix.Wait4(-1, nil, unix.WNOHANG|unix.WALL, nil); err != unix.ECHILD {
		t.Errorf("a child is left behind (wait4: %v)", err)
	}
}

// TestIDMapNSTaskDiesWithItsProcess: a process killed while it makes an
// id-mapping namespace leaves no task behind holding its descriptors (the
// task shares the fd table: an edge killed mid-create could not listen on
// its address again). A helper process makes namespaces in a loop with a
// listener open and is killed at varied moments; each time its port must
// be free again at once.
func TestIDMapNSTaskDiesWithItsProcess(t *testing.T) {
	if os.Getenv("DSEC_IDMAP_LOOP") == "1" {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			os.Exit(2)
		}
		fmt.Println(ln.Addr().String())
		for {
			if ns, err := NewIDMapNS(IDMap{HostID: 1_000_131_072, Size: 65536}); err == nil {
				ns.Close()
			}
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: makes user namespaces with mappings")
	}
	for i := range 40 {
		cmd := exec.Command(os.Args[0], "-test.run=^TestIDMapNSTaskDiesWithItsProcess$")
		cmd.Env = append(os.Environ(), "DSEC_IDMAP_LOOP=1")
		out, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		addr, err := bufio.NewReader(out).ReadString('\n')
		if err != nil {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("helper: %v", err)
		}
		time.Sleep(time.Duration(20+i*7) * time.Millisecond)
		cmd.Process.Kill()
		cmd.Wait()
		addr = strings.TrimSpace(addr)
		var ln net.Listener
		for deadline := time.Now().Add(2 * time.Second); ; time.Sleep(20 * time.Millisecond) {
			if ln, err = net.Listen("tcp", addr); err == nil || time.Now().After(deadline) {
				break
			}
		}
		if err != nil {
			t.Fatalf("kill %d: the killed process's address %s is still held: %v", i, addr, err)
		}
		ln.Close()
	}
}
