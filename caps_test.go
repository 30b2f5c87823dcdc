package asynqmutex

// A reached cap outlasts asynq's backoff; a waiting set keeps the keys before the
// busy one.

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"

	"github.com/asynqmutex/asynqmutex/mutex"
)

// TestMaxReschedulesOutlivesAsynqBackoff: past the cap a conflict is an ordinary
// failure, and asynq retries it after its own backoff (DefaultRetryDelayFunc:
// n^4+15s and more), which passes an hour from the 8th retry on. The count must
// still be there when the task comes back, so that every conflict after the cap
// fails as MaxReschedules promises, rather than count as a first one again.
func TestMaxReschedulesOutlivesAsynqBackoff(t *testing.T) {
	locks, m := newLocks(t)
	held, err := locks.TryLock(context.Background(), `["pay","t1"]`, mutex.MaxTTL) // outlives every FastForward
	require.NoError(t, err)
	defer func() { _ = held.Unlock(context.Background()) }()
	task := newFakeTask("t1", 25) // asynq's default MaxRetry
	h := Middleware(locks, On("id"), OnConflict(RetryLater(time.Second)), MaxReschedules(2), task.option())(mustNotRun(t))
	ctx := context.Background()

	rescheduled(t, h.ProcessTask(ctx, payTask("t1")), time.Second, "conflict 1")
	rescheduled(t, h.ProcessTask(ctx, payTask("t1")), 2*time.Second, "conflict 2")
	err = h.ProcessTask(ctx, payTask("t1"))
	failedAtCap(t, err, "MaxReschedules(2)", "3 conflicts")
	for n := 1; n < 24; n++ {
		task.retried() // asynq spent a retry on the failure, and waits its backoff
		delay := asynq.DefaultRetryDelayFunc(n, err, payTask("t1"))
		m.FastForward(delay)
		// The backoffs add up past the longest lease: hold the key again when it ran out.
		if l, err := locks.TryLock(ctx, `["pay","t1"]`, mutex.MaxTTL); err == nil {
			defer func() { _ = l.Unlock(context.Background()) }()
		}
		err = h.ProcessTask(ctx, payTask("t1"))
		var le *LockedError
		if errors.As(err, &le) {
			t.Fatalf("retry %d, after asynq's backoff of %v: the conflict was rescheduled again (%v): the cap's count expired (record lives %v) and restarted", n, delay, err, recordExpiry(time.Second))
		}
		failedAtCap(t, err, "MaxReschedules(2)")
	}
}

// TestOnEachWaitingSetBlocksItsOtherKeys: with MaxWait, a transfer A→B that waits
// for B keeps A meanwhile (see mutex.Client.LockKeys, "the price of that order"), so
// a deposit on A meets a busy key, as OnEach and the README say, though no task runs
// on A yet.
func TestOnEachWaitingSetBlocksItsOtherKeys(t *testing.T) {
	locks, m := newLocks(t)
	ctx := context.Background()
	hb, err := locks.TryLock(ctx, `["account","B"]`, time.Minute)
	require.NoError(t, err)

	transferRan := make(chan struct{})
	transfer := Middleware(locks, OnEach("from", "to"), Scope("account"), MaxWait(20*time.Second))(
		asynq.HandlerFunc(func(context.Context, *asynq.Task) error { close(transferRan); return nil }))
	done := make(chan error, 1)
	go func() {
		done <- transfer.ProcessTask(ctx, asynq.NewTask("transfer", []byte(`{"from":"A","to":"B"}`)))
	}()
	require.Eventually(t, func() bool {
		n, err := m.List(`asynqmutex:{["account","B"]}:wait`)
		return err == nil && len(n) > 0
	}, 10*time.Second, 5*time.Millisecond, "the transfer never waited for B")

	var rec recorder
	depositRan := false
	deposit := Middleware(locks, On("account"), Scope("account"), OnConflict(Skip), AfterFailure(rec.hook))(
		asynq.HandlerFunc(func(context.Context, *asynq.Task) error { depositRan = true; return nil }))
	require.NoError(t, deposit.ProcessTask(ctx, asynq.NewTask("deposit", []byte(`{"account":"A"}`))))
	if depositRan || len(rec.got()) != 1 {
		t.Errorf("the deposit on A ran (%v) or was not refused once (%v): the waiting transfer keeps A", depositRan, rec.got())
	}

	require.NoError(t, hb.Unlock(ctx))
	select {
	case err := <-done:
		require.NoError(t, err)
		<-transferRan
	case <-time.After(20 * time.Second):
		t.Fatal("the transfer did not run once B was free")
	}
}
