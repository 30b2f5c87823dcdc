package keyset

import (
	"fmt"
	"slices"
	"testing"
)

func TestDistinct(t *testing.T) {
	many := make([]string, 100)
	for i := range many {
		many[i] = fmt.Sprint(i % 37)
	}
	want37 := make([]string, 37)
	for i := range want37 {
		want37[i] = fmt.Sprint(i)
	}
	for _, tt := range []struct{ in, want []string }{
		{nil, nil},
		{[]string{"a"}, []string{"a"}},
		{[]string{"a", "b", "a", "c", "b"}, []string{"a", "b", "c"}},
		{[]string{"b", "b"}, []string{"b"}},
		{many, want37},
		{want37, want37},
	} {
		if got := Distinct(tt.in); !slices.Equal(got, tt.want) {
			t.Errorf("Distinct(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
