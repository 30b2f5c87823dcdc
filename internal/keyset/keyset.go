// Package keyset holds what the middleware and package mutex both do with a set of
// lock keys.
package keyset

// Distinct returns keys without repeats, in the order each first appears: keys
// itself when it has none (then it is not copied). Linear in len(keys): a few keys
// are compared pairwise, more go through a map.
func Distinct(keys []string) []string {
	const small = 16
	if len(keys) <= small {
		for i := 1; i < len(keys); i++ {
			for j := range i {
				if keys[i] == keys[j] {
					return distinctFrom(keys, i)
				}
			}
		}
		return keys
	}
	seen := make(map[string]struct{}, len(keys))
	for i, k := range keys {
		if _, ok := seen[k]; ok {
			return distinctFrom(keys, i)
		}
		seen[k] = struct{}{}
	}
	return keys
}

// distinctFrom is Distinct for keys whose first repeat is at index i.
func distinctFrom(keys []string, i int) []string {
	out := make([]string, i, len(keys))
	copy(out, keys[:i])
	seen := make(map[string]struct{}, len(keys))
	for _, k := range out {
		seen[k] = struct{}{}
	}
	for _, k := range keys[i:] {
		if _, ok := seen[k]; !ok {
			seen[k] = struct{}{}
			out = append(out, k)
		}
	}
	return out
}
