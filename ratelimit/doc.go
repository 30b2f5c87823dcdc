// Package ratelimit limits how many times per interval something may start, per key,
// across every process that shares a Redis: at most 100 calls a minute per merchant,
// 10 emails a second per tenant. It is the asynqmutex middleware's Rate gate, and as
// usable on its own as package mutex.
//
// A Rate is n starts per interval with a burst. The limiter is GCRA (the generic
// cell rate algorithm, a leaky bucket kept as one timestamp): starts are spaced
// interval/n apart, and up to Burst may begin at once when the key was idle. With the
// default burst of 1, no window of the interval's length, wherever it falls, sees more
// than n starts: what an API that counts per sliding or fixed window allows. A fixed
// window counter would let 2n through around a window's boundary; a sliding log keeps
// a timestamp per start, where GCRA's decision reads one.
//
// Every decision is one script call on the Redis server, timed by the server's clock
// (no client clock is read), on one Redis key per limited key, so Redis Cluster
// works. Each call carries a random identity and the start it takes is recorded
// under it for 10 to 20 seconds, so a call that go-redis sends again after a lost
// reply finds its own start and reports it rather than taking a second one, and never
// reports "limited" because of its own first run.
//
// Most callers want Allow, which answers at once, or Take, which waits up to a
// given time for the next start (Wait: until the context's deadline); Reserve takes a
// start ahead for callers that sleep themselves, and Cancel gives one back; TakeAs
// holds a start for a named caller that leaves and comes back for it. Pause
// holds every start of a key for a while (an API answered 429 with Retry-After), the
// starts already waiting included; Resume ends it. Reset forgets a key's starts. A
// start may weigh more than one (Rate.Cost). Inspect and List show a key's
// state for people. docs/ratelimit.md has the algorithm and its costs.
package ratelimit
