package iam

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
)

// hookStore runs a hook after the first List of a bucket and after a
// Create, to play another apiserver writing in the middle of an operation.
// It keeps the wrapped store's Watcher.
type hookStore struct {
	store.Store
	mu          sync.Mutex
	afterList   map[string]func() // by bucket; runs once
	afterCreate func(bucket, key string)
}

func (s *hookStore) List(bucket, prefix string) ([]store.KV, error) {
	kvs, err := s.Store.List(bucket, prefix)
	s.mu.Lock()
	hook := s.afterList[bucket]
	delete(s.afterList, bucket)
	s.mu.Unlock()
	if hook != nil {
		hook()
	}
	return kvs, err
}

func (s *hookStore) Create(bucket, key string, val []byte) error {
	err := s.Store.Create(bucket, key, val)
	s.mu.Lock()
	hook := s.afterCreate
	s.mu.Unlock()
	if err == nil && hook != nil {
		hook(bucket, key)
	}
	return err
}

func (s *hookStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, change)
}

// putProject writes a project straight into st, as another apiserver or a
// corrupt store would have it.
func putProject(t *testing.T, st store.Store, proj Project) {
	t.Helper()
	val, _ := json.Marshal(proj)
	if err := st.Put(bucketProjects, proj.ID, val); err != nil {
		t.Fatal(err)
	}
}

// putKey registers key for p straight into st, as another apiserver would.
func putKey(t *testing.T, st store.Store, key string, p Principal) {
	t.Helper()
	h := hashKey(key).hex()
	p.ID = principalID(h)
	val, _ := json.Marshal(p)
	if err := st.Put(bucketKeys, h, val); err != nil {
		t.Fatal(err)
	}
}

func ptr[T any](v T) *T { return &v }

func TestPath(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := newTeamsOn(t, mode.iam(t).st)
			for id, want := range map[string]string{RootProject: "root", "team-a": "root/team-a", "a-sub": "root/team-a/a-sub"} {
				if got, err := m.Path(id); err != nil || got != want {
					t.Errorf("Path(%s) = %q, %v; want %q", id, got, err, want)
				}
			}
			_, err := m.Path("nope")
			wantErr(t, "Path(missing)", err, errdefs.ErrNotFound)
			_, err = m.Path("")
			wantErr(t, "Path(empty)", err, errdefs.ErrInvalid)
		})
	}
}

func TestUpdateProject(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := mode.iam(t)
			for _, p := range []struct {
				parent, name string
				q            Quota
			}{
				{RootProject, "team-a", Quota{Sandboxes: 100, CPU: 50, MemoryMB: 65536, DiskMB: 1000}},
				{"team-a", "a-sub", Quota{Sandboxes: 10}},
				{"a-sub", "a-sub-sub", Quota{Sandboxes: 8}},
				{RootProject, "team-b", Quota{}},
			} {
				if _, err := m.CreateProject(rootAdmin, p.parent, p.name, p.q, false); err != nil {
					t.Fatal(err)
				}
			}
			adminA := Principal{Project: "team-a", Role: RoleAdmin}
			memberA := Principal{Project: "team-a", Role: RoleMember}
			tests := []struct {
				name      string
				by        Principal
				id        string
				quota     *Quota
				dedicated *bool
				want      error
				wantQuota Quota // after, if no error
			}{
				{"root raises team-a", rootAdmin, "team-a", &Quota{Sandboxes: 200, CPU: 50, MemoryMB: 65536, DiskMB: 1000}, nil, nil, Quota{Sandboxes: 200, CPU: 50, MemoryMB: 65536, DiskMB: 1000}},
				{"own project", adminA, "team-a", &Quota{Sandboxes: 1000}, nil, errdefs.ErrPermissionDenied, Quota{}},
				{"own project, dedicated only", adminA, "team-a", nil, ptr(true), errdefs.ErrPermissionDenied, Quota{}},
				{"within parent", adminA, "a-sub", &Quota{Sandboxes: 20, DiskMB: 1000}, nil, nil, Quota{Sandboxes: 20, DiskMB: 1000}},
				{"over parent", adminA, "a-sub", &Quota{Sandboxes: 201}, nil, errdefs.ErrQuota, Quota{}},
				{"disk over parent", adminA, "a-sub", &Quota{DiskMB: 1001}, nil, errdefs.ErrQuota, Quota{}},
				{"below its child", adminA, "a-sub", &Quota{Sandboxes: 2}, nil, nil, Quota{Sandboxes: 2}},
				{"dedicated only", adminA, "a-sub", nil, ptr(true), nil, Quota{Sandboxes: 2}},
				{"nothing", adminA, "a-sub", nil, nil, nil, Quota{Sandboxes: 2}},
				{"sibling", adminA, "team-b", &Quota{}, nil, errdefs.ErrPermissionDenied, Quota{}},
				{"member", memberA, "a-sub", &Quota{}, nil, errdefs.ErrPermissionDenied, Quota{}},
				{"root", rootAdmin, RootProject, &Quota{Sandboxes: 1}, nil, errdefs.ErrInvalid, Quota{}},
				{"root, dedicated", rootAdmin, RootProject, nil, ptr(true), errdefs.ErrInvalid, Quota{}},
				{"missing", rootAdmin, "nope", &Quota{}, nil, errdefs.ErrNotFound, Quota{}},
				{"negative", rootAdmin, "team-b", &Quota{CPU: -1}, nil, errdefs.ErrInvalid, Quota{}},
			}
			for _, tc := range tests {
				got, err := m.UpdateProject(tc.by, tc.id, tc.quota, tc.dedicated)
				wantErr(t, tc.name, err, tc.want)
				if err != nil {
					continue
				}
				stored, err := m.GetProject(rootAdmin, tc.id)
				if err != nil || stored != got || got.Quota != tc.wantQuota {
					t.Errorf("%s: UpdateProject = %+v; stored %+v, %v; want quota %+v", tc.name, got, stored, err, tc.wantQuota)
				}
			}
			if p, _ := m.GetProject(rootAdmin, "a-sub"); !p.DedicatedNodes || p.CreatedAt.IsZero() {
				t.Errorf("a-sub = %+v; want dedicated, created_at kept", p)
			}

			// a-sub (2) is now below a-sub-sub (8): the minimum binds.
			lineage, err := m.Lineage("a-sub-sub")
			if err != nil {
				t.Fatal(err)
			}
			if eff := effectiveQuota(lineage); eff.Sandboxes != 2 || eff.CPU != 50 {
				t.Errorf("effective quota of a-sub-sub = %+v; want 2 sandboxes, 50 cpu", eff)
			}
			_, err = m.CreateProject(adminA, "a-sub-sub", "deeper", Quota{Sandboxes: 3}, false)
			wantErr(t, "create over a lowered grandparent", err, errdefs.ErrQuota)
			_, err = m.UpdateProject(adminA, "a-sub-sub", &Quota{Sandboxes: 8}, nil)
			wantErr(t, "update over a lowered parent", err, errdefs.ErrQuota)
		})
	}
}

// slowStore makes every read of a project slow, so that a read-then-write
// update (instead of a compare-and-set) would lose one of two concurrent
// writes nearly every time.
type slowStore struct{ store.Store }

func (s slowStore) Get(bucket, key string) ([]byte, error) {
	val, err := s.Store.Get(bucket, key)
	if bucket == bucketProjects {
		time.Sleep(2 * time.Millisecond)
	}
	return val, err
}

func (s slowStore) WatchBucket(ctx context.Context, bucket string, reset func([]store.KV), change func(string, []byte)) {
	s.Store.(store.Watcher).WatchBucket(ctx, bucket, reset, change)
}

// TestUpdateProjectConcurrent: two apiservers (two IAMs on one store)
// change one project at once, one the dedicated flag, the other the quota;
// after every round both changes are there.
func TestUpdateProjectConcurrent(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			st := store.NewMemory()
			a := mode.on(t, slowStore{st})
			b := mode.on(t, slowStore{st})
			if _, err := a.CreateProject(rootAdmin, RootProject, "shared", Quota{}, false); err != nil {
				t.Fatal(err)
			}
			for round := 1; round <= 20; round++ {
				dedicated := round%2 == 1
				var wg sync.WaitGroup
				start := make(chan struct{})
				wg.Add(2)
				go func() {
					defer wg.Done()
					<-start
					if _, err := a.UpdateProject(rootAdmin, "shared", nil, &dedicated); err != nil {
						t.Error(err)
					}
				}()
				go func() {
					defer wg.Done()
					<-start
					if _, err := b.UpdateProject(rootAdmin, "shared", &Quota{Sandboxes: round}, nil); err != nil {
						t.Error(err)
					}
				}()
				close(start)
				wg.Wait()
				p, err := newIAM(t, st).GetProject(rootAdmin, "shared")
				if err != nil {
					t.Fatal(err)
				}
				if p.DedicatedNodes != dedicated || p.Quota.Sandboxes != round {
					t.Fatalf("round %d: stored %+v; want dedicated %v and %d sandboxes (a lost update)", round, p, dedicated, round)
				}
			}
		})
	}
}

func TestDeleteProject(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := mode.iam(t)
			for _, p := range []struct{ parent, name string }{
				{RootProject, "team-a"}, {"team-a", "a-1"}, {"a-1", "a-1-x"}, {"a-1-x", "a-1-x-y"}, {"a-1", "a-1-z"},
				{"team-a", "a-2"}, {"team-a", "leaf"}, {RootProject, "team-b"},
			} {
				if _, err := m.CreateProject(rootAdmin, p.parent, p.name, Quota{}, false); err != nil {
					t.Fatal(err)
				}
			}
			adminA := Principal{Project: "team-a", Role: RoleAdmin}
			keys := map[string]string{}
			for _, proj := range []string{"team-a", "a-1", "a-1-x", "a-1-x-y", "a-1-z", "a-2", "leaf", "team-b"} {
				keys[proj], _ = mustKey(t, m, rootAdmin, proj, RoleMember)
			}

			refusals := []struct {
				name    string
				by      Principal
				id      string
				cascade bool
				want    error
			}{
				{"root", rootAdmin, RootProject, true, errdefs.ErrInvalid},
				{"own project", adminA, "team-a", true, errdefs.ErrPermissionDenied},
				{"sibling", adminA, "team-b", false, errdefs.ErrPermissionDenied},
				{"member", Principal{Project: "team-a", Role: RoleMember}, "leaf", false, errdefs.ErrPermissionDenied},
				{"builder", Principal{Project: "team-a", Role: RoleBuilder}, "leaf", false, errdefs.ErrPermissionDenied},
				{"missing", adminA, "nope", false, errdefs.ErrNotFound},
				{"children without cascade", adminA, "a-1", false, errdefs.ErrPrecondition},
			}
			for _, tc := range refusals {
				ids, err := m.DeleteProject(tc.by, tc.id, tc.cascade)
				wantErr(t, tc.name, err, tc.want)
				if len(ids) != 0 {
					t.Errorf("%s: deleted %v", tc.name, ids)
				}
			}
			_, err := m.DeleteProject(adminA, "a-1", false)
			if err == nil || !strings.Contains(err.Error(), "cascade") || !strings.Contains(err.Error(), "a-1-x") {
				t.Errorf("refusal does not say why: %v", err)
			}
			for proj, key := range keys {
				if _, err := m.Authenticate(key); err != nil {
					t.Fatalf("a refused delete revoked the key of %s: %v", proj, err)
				}
			}

			ids, err := m.DeleteProject(adminA, "leaf", false)
			if err != nil || strings.Join(ids, ",") != "leaf" {
				t.Errorf("DeleteProject(leaf) = %v, %v", ids, err)
			}
			ids, err = m.DeleteProject(adminA, "a-1", true)
			if err != nil || strings.Join(ids, ",") != "a-1-x-y,a-1-x,a-1-z,a-1" {
				t.Errorf("DeleteProject(a-1, cascade) = %v, %v; want deepest first", ids, err)
			}
			for _, proj := range []string{"leaf", "a-1", "a-1-x", "a-1-x-y", "a-1-z"} {
				_, err := m.GetProject(rootAdmin, proj)
				wantErr(t, "GetProject(deleted "+proj+")", err, errdefs.ErrNotFound)
				_, err = m.Authenticate(keys[proj])
				wantErr(t, "key of deleted "+proj, err, errdefs.ErrUnauthenticated)
			}
			for _, proj := range []string{"team-a", "a-2", "team-b"} {
				if _, err := m.Authenticate(keys[proj]); err != nil {
					t.Errorf("key of %s revoked: %v", proj, err)
				}
			}
			kids, err := m.Children(rootAdmin, "team-a")
			if err != nil || len(kids) != 1 || kids[0].ID != "a-2" {
				t.Errorf("Children(team-a) = %+v, %v", kids, err)
			}

			// The name is free again, and the old keys stay dead in
			// the new project of that name.
			if _, err := m.CreateProject(adminA, "team-a", "a-1", Quota{}, false); err != nil {
				t.Fatalf("re-creating a-1: %v", err)
			}
			_, err = m.Authenticate(keys["a-1"])
			wantErr(t, "old key of a re-created project", err, errdefs.ErrUnauthenticated)
			if ks, err := m.ListKeys(rootAdmin, "a-1"); err != nil || len(ks) != 0 {
				t.Errorf("ListKeys(re-created a-1) = %v, %v", ks, err)
			}
		})
	}
}

// TestDeleteProjectSweepsConcurrentWrites: a subproject and a key created
// (on another apiserver) in a project while it is deleted do not survive
// it, even without cascade.
func TestDeleteProjectSweepsConcurrentWrites(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			mem := store.NewMemory()
			hs := &hookStore{Store: mem, afterList: map[string]func(){}}
			m := newTeamsOn(t, mode.on(t, hs).st)
			if mode.name == "mirror" {
				m = watched(t, hs)
			}
			// After DeleteProject lists the projects (a-sub is a leaf
			// then), another apiserver creates a-sub/late; after it
			// lists the keys, one is minted in a-sub.
			hs.afterList[bucketProjects] = func() {
				putProject(t, mem, Project{ID: "late", Parent: "a-sub", Name: "late"})
			}
			hs.afterList[bucketKeys] = func() {
				putKey(t, mem, "dsec_late_key_in_a_sub", Principal{Project: "a-sub", Role: RoleViewer})
			}
			ids, err := m.DeleteProject(rootAdmin, "a-sub", false)
			if err != nil || strings.Join(ids, ",") != "late,a-sub" {
				t.Errorf("DeleteProject(a-sub) = %v, %v; want late,a-sub", ids, err)
			}
			if kvs, _ := mem.List(bucketProjects, ""); len(kvs) != 3 { // root, team-a, team-b
				t.Errorf("projects left: %v", kvs)
			}
			if _, err := m.Authenticate("dsec_late_key_in_a_sub"); err == nil {
				t.Error("a key minted during the delete survived it")
			}
			if kvs, _ := mem.List(bucketKeys, ""); len(kvs) != 0 {
				t.Errorf("keys left: %d", len(kvs))
			}
		})
	}
}

// TestCreateWithdrawnWhenParentDeleted: CreateProject and CreateKey that
// raced with a DeleteProject elsewhere withdraw their write.
func TestCreateWithdrawnWhenParentDeleted(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			mem := store.NewMemory()
			hs := &hookStore{Store: mem}
			m := mode.on(t, hs)
			if _, err := m.CreateProject(rootAdmin, RootProject, "doomed", Quota{}, false); err != nil {
				t.Fatal(err)
			}
			hs.afterCreate = func(bucket, key string) {
				if err := mem.Delete(bucketProjects, "doomed"); err != nil {
					t.Error(err)
				}
			}
			_, err := m.CreateProject(rootAdmin, "doomed", "kid", Quota{}, false)
			wantErr(t, "CreateProject under a parent deleted meanwhile", err, errdefs.ErrNotFound)
			if _, err := mem.Get(bucketProjects, "kid"); err == nil {
				t.Error("kid left without a parent")
			}

			putProject(t, mem, Project{ID: "doomed", Parent: RootProject, Name: "doomed"})
			key, _, err := m.CreateKey(rootAdmin, "doomed", RoleViewer, "", 0)
			wantErr(t, "CreateKey in a project deleted meanwhile", err, errdefs.ErrNotFound)
			if key != "" {
				t.Error("CreateKey returned a key")
			}
			if kvs, _ := mem.List(bucketKeys, ""); len(kvs) != 0 {
				t.Errorf("key left in a deleted project: %d", len(kvs))
			}
		})
	}
}

func TestSubtreeIDs(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := newTeamsOn(t, mode.iam(t).st)
			for id, want := range map[string]string{
				RootProject: "a-sub,root,team-a,team-b", "team-a": "a-sub,team-a", "a-sub": "a-sub", "team-b": "team-b",
			} {
				if got, err := m.SubtreeIDs(id); err != nil || strings.Join(got, ",") != want {
					t.Errorf("SubtreeIDs(%s) = %v, %v; want %s", id, got, err, want)
				}
			}
			_, err := m.SubtreeIDs("nope")
			wantErr(t, "SubtreeIDs(missing)", err, errdefs.ErrNotFound)
		})
	}
}

func TestListProjectsScopeAndLimits(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			m := newTeamsOn(t, mode.iam(t).st)
			viewerA := Principal{Project: "team-a", Role: RoleViewer}
			ids := func(ps []Project) string {
				var out []string
				for _, p := range ps {
					out = append(out, p.ID)
				}
				return strings.Join(out, ",")
			}
			tests := []struct {
				name          string
				by            Principal
				parent, after string
				limit         int
				want, next    string
				err           error
			}{
				{"root, all", rootAdmin, "", "", 0, "a-sub,root,team-a,team-b", "", nil},
				{"root, paged", rootAdmin, "", "", 2, "a-sub,root", "root", nil},
				{"root, page 2", rootAdmin, "", "root", 2, "team-a,team-b", "", nil},
				{"root's children", rootAdmin, RootProject, "", 0, "team-a,team-b", "", nil},
				{"viewer, all in scope", viewerA, "", "", 0, "a-sub,team-a", "", nil},
				{"viewer, paged", viewerA, "", "", 1, "a-sub", "a-sub", nil},
				{"viewer, page 2", viewerA, "", "a-sub", 1, "team-a", "", nil},
				{"viewer, children", viewerA, "team-a", "", 0, "a-sub", "", nil},
				{"viewer, leaf's children", viewerA, "a-sub", "", 0, "", "", nil},
				{"viewer, parent out of scope", viewerA, RootProject, "", 0, "", "", errdefs.ErrPermissionDenied},
				{"viewer, sibling", viewerA, "team-b", "", 0, "", "", errdefs.ErrPermissionDenied},
				{"missing parent", rootAdmin, "nope", "", 0, "", "", errdefs.ErrNotFound},
				{"negative limit", rootAdmin, "", "", -1, "", "", errdefs.ErrInvalid},
				{"no role", Principal{Project: "team-a"}, "", "", 0, "", "", errdefs.ErrPermissionDenied},
				{"principal's project gone", Principal{Project: "gone", Role: RoleAdmin}, "", "", 0, "", "", errdefs.ErrNotFound},
			}
			for _, tc := range tests {
				got, next, err := m.ListProjects(tc.by, tc.parent, tc.after, tc.limit)
				wantErr(t, tc.name, err, tc.err)
				if err == nil && (ids(got) != tc.want || next != tc.next) {
					t.Errorf("%s: ListProjects = %s, next %q; want %s, next %q", tc.name, ids(got), next, tc.want, tc.next)
				}
			}
		})
	}
}

// TestListProjectsTenThousand pages over 10,000 children, in both modes;
// with the mirror no page reads the store.
func TestListProjectsTenThousand(t *testing.T) {
	if testing.Short() {
		t.Skip("creates 10,000 projects")
	}
	const n = 10_000
	cs := &countingStore{Store: store.NewMemory()}
	m := watched(t, cs)
	if _, err := m.CreateProject(rootAdmin, RootProject, "big", Quota{}, false); err != nil {
		t.Fatal(err)
	}
	for i := range n {
		if _, err := m.CreateProject(rootAdmin, "big", fmt.Sprintf("c%05d", i), Quota{}, false); err != nil {
			t.Fatal(err)
		}
	}
	plain := newIAM(t, plainStore{cs.Store})
	bigAdmin := Principal{Project: "big", Role: RoleAdmin}

	for _, tc := range []struct {
		name   string
		by     Principal
		parent string
		want   int
	}{
		{"children of big", rootAdmin, "big", n},
		{"everything, as root", rootAdmin, "", n + 2},
		{"everything, as big's admin", bigAdmin, "", n + 1},
	} {
		for _, limit := range []int{1000, 5000} { // 5000 is cut to 1000
			var mirrored, stored []string
			sides := []struct {
				m   *IAM
				out *[]string
			}{{m, &mirrored}, {plain, &stored}}
			if limit != maxPageSize {
				sides = sides[:1] // without a mirror each page lists the store: once is enough
			}
			for _, side := range sides {
				gets, lists := cs.gets.Load(), cs.lists.Load()
				after, pages := "", 0
				for {
					page, next, err := side.m.ListProjects(tc.by, tc.parent, after, limit)
					if err != nil {
						t.Fatalf("%s: %v", tc.name, err)
					}
					if len(page) > maxPageSize {
						t.Fatalf("%s: page of %d", tc.name, len(page))
					}
					pages++
					for _, p := range page {
						*side.out = append(*side.out, p.ID)
					}
					if next == "" {
						break
					}
					if next != page[len(page)-1].ID {
						t.Fatalf("%s: next %q is not the page's last ID", tc.name, next)
					}
					after = next
				}
				if side.m == m && (cs.gets.Load() != gets || cs.lists.Load() != lists) {
					t.Errorf("%s: paging with the mirror read the store (%d gets, %d lists)", tc.name, cs.gets.Load()-gets, cs.lists.Load()-lists)
				}
				if want := (tc.want + maxPageSize - 1) / maxPageSize; pages != want {
					t.Errorf("%s: %d pages, want %d", tc.name, pages, want)
				}
			}
			if len(sides) == 1 {
				stored = mirrored
			}
			if len(mirrored) != tc.want || strings.Join(mirrored, ",") != strings.Join(stored, ",") {
				t.Fatalf("%s: mirror listed %d, store %d (want %d), or they differ", tc.name, len(mirrored), len(stored), tc.want)
			}
			for i := 1; i < len(mirrored); i++ {
				if mirrored[i-1] >= mirrored[i] {
					t.Fatalf("%s: not in ID order at %d: %s, %s", tc.name, i, mirrored[i-1], mirrored[i])
				}
			}
		}
	}
}

// TestCorruptStore: a store holding cycles, a dangling parent, a chain
// deeper than maxDepth or a tree off the root makes every question fail or
// answer, never hang.
func TestCorruptStore(t *testing.T) {
	for _, mode := range storeModes {
		t.Run(mode.name, func(t *testing.T) {
			mem := store.NewMemory()
			m := mode.on(t, mem)
			putProject(t, mem, Project{ID: "x", Parent: "y", Name: "x"})
			putProject(t, mem, Project{ID: "y", Parent: "x", Name: "y"})
			putProject(t, mem, Project{ID: "self", Parent: "self", Name: "self"})
			putProject(t, mem, Project{ID: "lost", Parent: "ghost", Name: "lost"})
			putProject(t, mem, Project{ID: "other-top", Name: "other-top"})
			putProject(t, mem, Project{ID: "under-other", Parent: "other-top", Name: "under-other"})
			parent := RootProject
			for i := 1; i <= maxDepth+6; i++ {
				id := fmt.Sprintf("c%d", i)
				putProject(t, mem, Project{ID: id, Parent: parent, Name: id})
				parent = id
			}
			if err := mem.Put(bucketProjects, "liar", []byte(`{"id":"someone-else","parent":"root"}`)); err != nil {
				t.Fatal(err)
			}

			done := make(chan struct{})
			go func() {
				defer close(done)
				for _, id := range []string{"x", "y", "self", "lost", "under-other", "other-top", fmt.Sprintf("c%d", maxDepth+1), fmt.Sprintf("c%d", maxDepth+6), "liar"} {
					if err := m.AuthorizeIn(rootAdmin, SandboxRead, id); err == nil {
						t.Errorf("AuthorizeIn(root admin, %s) allowed", id)
					}
					if _, err := m.Lineage(id); err == nil {
						t.Errorf("Lineage(%s) succeeded", id)
					}
					if _, err := m.Path(id); err == nil {
						t.Errorf("Path(%s) succeeded", id)
					}
					if _, err := m.CreateProject(rootAdmin, id, "kid-of-"+strings.ReplaceAll(id, "-", ""), Quota{}, false); err == nil {
						t.Errorf("CreateProject under %s succeeded", id)
					}
					if _, err := m.UpdateProject(rootAdmin, id, &Quota{}, nil); err == nil {
						t.Errorf("UpdateProject(%s) succeeded", id)
					}
					if _, err := m.DeleteProject(rootAdmin, id, true); err == nil {
						t.Errorf("DeleteProject(%s) succeeded", id)
					}
					_, _ = m.SubtreeIDs(id) // answers or fails; must return
				}
				// The deepest legal project of the chain still works.
				deepest := fmt.Sprintf("c%d", maxDepth)
				if err := m.AuthorizeIn(rootAdmin, SandboxRead, deepest); err != nil {
					t.Errorf("AuthorizeIn(%s): %v", deepest, err)
				}
				all, _, err := m.ListProjects(rootAdmin, "", "", maxPageSize)
				if err != nil {
					t.Errorf("ListProjects(root): %v", err)
				}
				for _, p := range all {
					switch p.ID {
					case "x", "y", "self", "lost", "other-top", "under-other":
						t.Errorf("ListProjects(root) lists %s, which is not below the root", p.ID)
					}
				}
				x := Principal{Project: "x", Role: RoleAdmin}
				if _, _, err := m.ListProjects(x, "", "", 0); err != nil {
					t.Errorf("ListProjects(in a cycle): %v", err)
				}
			}()
			select {
			case <-done:
			case <-time.After(30 * time.Second):
				t.Fatal("a question about a corrupt store did not return")
			}
		})
	}
}
