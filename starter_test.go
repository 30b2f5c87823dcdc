package asynqmutex

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/stretchr/testify/require"
)

// TestStarterLeavesATaskToItsNearFallback: a parked task whose fallback is due within
// fallbackMargin is not started (asynq may bring it back, run and complete it before
// RunTask, which would then run it again): it comes by that fallback. One whose
// fallback is further away is started (the control).
func TestStarterLeavesATaskToItsNearFallback(t *testing.T) {
	t.Parallel()
	locks, _ := newLocks(t)
	client := asynq.NewClientFromRedisClient(locks.Redis())
	insp := asynq.NewInspectorFromRedisClient(locks.Redis())
	s := &starter{insp: insp, log: slog.Default, emit: func(context.Context, Event) {}}
	queue := "starter-" + t.Name()
	enqueue := func(in time.Duration) string {
		info, err := client.Enqueue(asynq.NewTask("sync", nil), asynq.Queue(queue), asynq.ProcessIn(in))
		require.NoError(t, err)
		return info.ID
	}
	state := func(id string) asynq.TaskState {
		info, err := insp.GetTaskInfo(queue, id)
		require.NoError(t, err)
		return info.State
	}
	near, far := enqueue(fallbackMargin/2), enqueue(time.Hour)
	require.Empty(t, s.start(context.Background(), parkedTask{key: "k", ticket: ticket(queue, near)}))
	require.Empty(t, s.start(context.Background(), parkedTask{key: "k", ticket: ticket(queue, far)}))
	require.Equal(t, asynq.TaskStateScheduled, state(near), "a task whose fallback is near is left to it")
	require.Equal(t, asynq.TaskStatePending, state(far), "a task whose fallback is an hour away is started")
	_ = insp.DeleteQueue(queue, true)
}
