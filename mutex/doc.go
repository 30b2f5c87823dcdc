// Package mutex is a distributed lock on Redis: token-safe, idempotent under lost
// replies, one round trip per step, with fencing tokens and waiters that are handed
// the lock when the holder releases it instead of polling.
//
// Most callers want [Client.WithLock]: it takes the lock (waiting if asked), renews
// the lease while fn runs, cancels fn's context the moment the lease is lost, and
// always releases. [Client.TryLock] and [Client.Lock] return a [Lock] to manage by
// hand. The same calls take several keys as one lock ([Client.WithLockKeys]) or let
// up to n holders share a key ([Limit]).
//
// A lock on a single Redis is an efficiency lock: it keeps two workers from doing the
// same job at once nearly always, but a process pause longer than the lease, a
// failover that loses the key, or a restart without persistence can let two holders
// overlap. Where overlap would corrupt data, pass [Lock.Fence] to the resource and
// have it reject any write carrying a fence lower than one it has seen.
//
// Fences: a fence is the larger of the previous fence of the key plus one and the
// Redis server's clock in microseconds, taken in the acquiring script. Fences
// therefore keep increasing across a restart without persistence, a restore from an
// older RDB or AOF snapshot and a replica's promotion, as long as the server's clock
// does not go back; no counter key is kept.
//
// Keys: the Redis key of a lock is prefix + "{" + encoded key + "}", and everything
// else of the lock (its queue of waiters) starts with it, so shares its Redis Cluster
// hash slot. The encoding escapes '%', '{', '}' and '#' and replaces keys longer than
// 256 bytes after escaping by their first 64 bytes, '#' and a SHA-256 digest, so
// distinct keys never share a Redis key and every key is bounded. docs/protocol.md
// maps every key, value and script.
package mutex
