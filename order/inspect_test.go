package order

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
)

// TestList yields every key of the prefix with a sequence, the finished ones too,
// a long key by its first bytes, and nothing that is not a sequence.
func TestList(t *testing.T) {
	t.Parallel()
	rdb, ctx := sharedServer(t), context.Background()
	prefix := uniqueKey(t) + ":"
	s := New(rdb, Prefix(prefix))
	long := `["report:export","` + strings.Repeat("x", 400) + `"]`
	for k, id := range map[string]string{`["transfer","a"]`: "task-a", `["transfer","b"]`: "task-b", long: "task-l"} {
		if _, err := s.Take(ctx, k, "q", id); err != nil {
			t.Fatal(err)
		}
	}
	p, err := s.Take(ctx, `["transfer","b"]`, "q", "task-b2")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []int64{1, 2} { // every place of b finished
		if _, err := s.Finish(ctx, `["transfer","b"]`, Place{Epoch: p.Epoch, N: n}, Done); err != nil {
			t.Fatal(err)
		}
	}
	// A lock of the same prefix, and a hash that is no sequence of it.
	if err := rdb.Set(ctx, prefix+`{["transfer","a"]}`, "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := rdb.HSet(ctx, prefix+"orders", "a", "b").Err(); err != nil {
		t.Fatal(err)
	}

	got := map[string]State{}
	for st, err := range s.List(ctx) {
		if err != nil {
			t.Fatal(err)
		}
		got[st.Key] = st
	}
	if keys := slices.Sorted(maps.Keys(got)); len(keys) != 3 {
		t.Fatalf("List yields %q, want the 3 keys with a sequence", keys)
	}
	if a := got[`["transfer","a"]`]; a.Digested || a.Next != 1 || a.Last != 1 || a.Holder.TaskID != "task-a" ||
		a.RedisKey != redisKey(prefix, `["transfer","a"]`) {
		t.Errorf("List's a = %+v, want next 1 of 1, held by its task", a)
	}
	if b := got[`["transfer","b"]`]; b.Waiting() != 0 || b.Next != 3 || b.Epoch == "" {
		t.Errorf("List's b = %+v, want every place finished, next 3", b)
	}
	if l := got[long[:64]]; !l.Digested || l.Last != 1 {
		t.Errorf("List's long key = %+v, want its first 64 bytes, digested", l)
	}
}
