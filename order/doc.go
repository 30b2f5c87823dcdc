// Package order keeps, per key, the order in which tasks were given their places, on a
// Redis that every producer and worker shares: the asynqmutex middleware's InOrder
// gate, on the same store as package mutex and package ratelimit.
//
// A producer takes a place in its key's sequence with Take, one script call that
// increments the key's counter and records the task that holds the place (its asynq
// task ID and queue). The place travels with the task (FormatPlace, ParsePlace; the
// middleware puts it in the task's Header). A worker asks Enter whether a place's turn
// has come: it has when every earlier place is finished. Finish marks a place finished
// (done, or skipped past) and wakes the tasks waiting for the key (Await, never
// polling: the Awaits of a Sequencer share one pub/sub connection, subscribed to the
// channels of the keys they wait on; a Watch keeps a caller listening across several
// waits). Requeue tells them that the next place's task stopped and will run again
// later. FinishLater sends a Finish in the round trip of another call, a lock's
// release.
//
// A key's sequence is one Redis hash; each place taken and not yet finished is one
// field of it. A sequence idle (every place finished) for IdleKeep is forgotten, and
// the next Take starts a new one with a new epoch, so a place from a forgotten
// sequence is recognised as such (TurnUnknown) rather than mistaken for one of the new
// sequence. docs/order.md states the guarantee and its limits; docs/protocol.md maps
// the keys.
package order
