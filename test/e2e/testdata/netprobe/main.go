// Command netprobe is what the network tests run inside sandboxes: a static
// binary (no libc, Go's own resolver reading /etc/resolv.conf) that makes
// one kind of connection and says what happened on stdout.
//
//	netprobe get URL             HTTP GET; prints the body
//	netprobe dial HOST:PORT      TCP connect; prints "connected"
//	netprobe resolve NAME        prints the IPv4 addresses
//	netprobe udp HOST:PORT MSG   sends one datagram
//	netprobe stream HOST:PORT    writes a numbered line every 100 ms until
//	                             a write fails; prints how many got out
//	netprobe scan HOST FROM TO   TCP connect to each port; prints the open ones
//	netprobe raw                 tries raw and packet sockets; prints errors
//	netprobe serve ADDR          HTTP server answering with the request's
//	                             method, path and headers
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"syscall"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fail("usage: netprobe get|dial|resolve|udp|stream|scan|raw ...")
	}
	switch os.Args[1] {
	case "get":
		c := http.Client{Timeout: 5 * time.Second}
		resp, err := c.Get(os.Args[2])
		if err != nil {
			fail(err.Error())
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		fmt.Printf("%d %s", resp.StatusCode, b)
	case "dial":
		c, err := net.DialTimeout("tcp4", os.Args[2], 3*time.Second)
		if err != nil {
			fail(err.Error())
		}
		c.Close()
		fmt.Println("connected")
	case "resolve":
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		addrs, err := net.DefaultResolver.LookupIP(ctx, "ip4", os.Args[2])
		if err != nil {
			fail(err.Error())
		}
		for _, a := range addrs {
			fmt.Println(a)
		}
	case "udp":
		c, err := net.Dial("udp4", os.Args[2])
		if err != nil {
			fail(err.Error())
		}
		_, err = c.Write([]byte(os.Args[3]))
		if err != nil {
			fail(err.Error())
		}
		fmt.Println("sent")
	case "stream":
		c, err := net.DialTimeout("tcp4", os.Args[2], 3*time.Second)
		if err != nil {
			fail(err.Error())
		}
		n := 0
		for ; n < 600; n++ {
			c.SetWriteDeadline(time.Now().Add(2 * time.Second))
			if _, err := fmt.Fprintf(c, "line %d\n", n); err != nil {
				break
			}
			time.Sleep(100 * time.Millisecond)
		}
		fmt.Println("wrote", n)
	case "scan":
		from, _ := strconv.Atoi(os.Args[3])
		to, _ := strconv.Atoi(os.Args[4])
		open := 0
		for p := from; p <= to; p++ {
			c, err := net.DialTimeout("tcp4", net.JoinHostPort(os.Args[2], strconv.Itoa(p)), 300*time.Millisecond)
			if err == nil {
				c.Close()
				fmt.Println("open", p)
				open++
			}
		}
		fmt.Println("scanned", to-from+1, "open", open)
	case "raw":
		for _, s := range []struct {
			name         string
			domain, kind int
			proto        int
		}{
			{"raw-icmp", syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_ICMP},
			{"raw-tcp", syscall.AF_INET, syscall.SOCK_RAW, syscall.IPPROTO_TCP},
			{"packet", syscall.AF_PACKET, syscall.SOCK_RAW, 0x0300},         // ETH_P_ALL, for ARP spoofing
			{"packet-dgram", syscall.AF_PACKET, syscall.SOCK_DGRAM, 0x0608}, // ETH_P_ARP
		} {
			fd, err := syscall.Socket(s.domain, s.kind, s.proto)
			if err == nil {
				syscall.Close(fd)
				fmt.Println(s.name, "OPENED")
				continue
			}
			fmt.Println(s.name, err)
		}
	case "serve":
		err := http.ListenAndServe(os.Args[2], http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fmt.Fprintf(w, "%s %s\n", r.Method, r.URL.RequestURI())
			r.Header.Write(w)
			if r.Body != nil {
				b, _ := io.ReadAll(r.Body)
				fmt.Fprintf(w, "body=%s\n", b)
			}
		}))
		fail(err.Error())
	default:
		fail("unknown command " + os.Args[1])
	}
}

func fail(msg string) {
	fmt.Println("error:", msg)
	os.Exit(1)
}
