package iam

import (
	"fmt"
	"testing"

	"github.com/dsecproject/dsec/internal/store"
)

// BenchmarkAuthenticate measures the per-request key check of a known key:
// from the mirror (etcd, watched) and from the cache (bbolt).
func BenchmarkAuthenticate(b *testing.B) {
	for _, mode := range []struct {
		name string
		st   func() store.Store
	}{{"mirror", store.NewMemory}, {"cache", func() store.Store { return plainStore{store.NewMemory()} }}} {
		b.Run(mode.name, func(b *testing.B) {
			m, err := New(mode.st())
			if err != nil {
				b.Fatal(err)
			}
			m.Watch(b.Context())
			key, _, err := m.CreateKey(rootAdmin, RootProject, RoleMember, "bench", 0)
			if err != nil {
				b.Fatal(err)
			}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := m.Authenticate(key); err != nil {
						b.Error(err)
						return
					}
				}
			})
		})
	}
}

// BenchmarkAuthorizeInNested measures AuthorizeIn for a key of a project 8
// levels below the root acting in its own project, and (root) the root's
// admin acting in that project, which walks all 8 levels.
func BenchmarkAuthorizeInNested(b *testing.B) {
	for _, mode := range []struct {
		name string
		st   func() store.Store
	}{{"mirror", store.NewMemory}, {"store", func() store.Store { return plainStore{store.NewMemory()} }}} {
		m, err := New(mode.st())
		if err != nil {
			b.Fatal(err)
		}
		m.Watch(b.Context())
		parent := RootProject
		for i := 1; i <= 8; i++ {
			name := fmt.Sprintf("level-%d", i)
			if _, err := m.CreateProject(rootAdmin, parent, name, Quota{}, false); err != nil {
				b.Fatal(err)
			}
			parent = name
		}
		_, p, err := m.CreateKey(rootAdmin, parent, RoleMember, "", 0)
		if err != nil {
			b.Fatal(err)
		}
		for _, by := range []struct {
			name string
			p    Principal
		}{{"own", p}, {"root", rootAdmin}} {
			b.Run(mode.name+"/"+by.name, func(b *testing.B) {
				b.ReportAllocs()
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						if err := m.AuthorizeIn(by.p, SandboxCreate, parent); err != nil {
							b.Error(err)
							return
						}
					}
				})
			})
		}
	}
}

// BenchmarkListProjectsPage measures one page of 100 deep into 10,000
// children, from the mirror.
func BenchmarkListProjectsPage(b *testing.B) {
	m, err := New(store.NewMemory())
	if err != nil {
		b.Fatal(err)
	}
	m.Watch(b.Context())
	if _, err := m.CreateProject(rootAdmin, RootProject, "big", Quota{}, false); err != nil {
		b.Fatal(err)
	}
	for i := range 10_000 {
		if _, err := m.CreateProject(rootAdmin, "big", fmt.Sprintf("c%05d", i), Quota{}, false); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if page, _, err := m.ListProjects(rootAdmin, "big", "c08000", 100); err != nil || len(page) != 100 {
			b.Fatal(len(page), err)
		}
	}
}
