package asynqmutex

import (
	"context"
	"errors"
	"fmt"

	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// lockGate takes the task's lock (or all its keys, or one of its key's Limit(n)
// slots), waiting up to what is left of its wait, and passes the task on while it
// holds it: the lock is renewed meanwhile and released when the rest of the path
// returns. It refuses the task when its key stays busy, and fails it when Redis
// cannot say. A lock lost while the handler ran is left in tk for the outcome.
func (m *middleware) lockGate(ctx context.Context, tk *task, next func(context.Context) error) error {
	var (
		entered bool
		inner   error // what the rest of the path returned
	)
	fn := func(ctx context.Context) error {
		entered = true
		inner = next(ctx)
		return nil // kept apart, so that err is only about the lock
	}
	wait, held := mutex.MaxWait(m.waitLeft(ctx, tk)), mutex.HeldBy(tk.Type(), tk.meta.id)
	var err error
	if tk.keys != nil {
		err = m.locks.WithLockKeys(ctx, tk.keys, m.ttl, fn, wait, held)
	} else {
		err = m.locks.WithLock(ctx, tk.key, m.ttl, fn, wait, held, m.limitOpt)
	}
	switch {
	case entered:
		if tk.ran && errors.Is(err, mutex.ErrNotHeld) {
			tk.leaseLost = err
		}
		// A release Redis could not confirm needs no retry of the task: the key
		// frees itself when its lease runs out.
		return inner
	case !errors.Is(err, mutex.ErrNotObtained) || ctx.Err() != nil:
		return &wrapError{
			msg: fmt.Sprintf("asynqmutex: task %s%s: taking lock%s: %s", shortkey.Quote(tk.Type()), idSuffix(tk.meta.id), unlessNamed(err, tk.key, tk.keys), oneLine(err)),
			err: err,
		}
	}
	le := &LockedError{Key: tk.key, Keys: tk.keys}
	if busy, ok := mutex.BusyKey(err); ok {
		le.Key = busy
	}
	return &refusal{op: OpConflict, le: le}
}
