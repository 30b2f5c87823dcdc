package asynqmutex

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hibiken/asynq"

	"github.com/asynqmutex/asynqmutex/order"
)

// noTasks is a TaskLookup that knows no task.
type noTasks struct{}

func (noTasks) GetTaskInfo(string, string) (*asynq.TaskInfo, error) {
	return nil, asynq.ErrTaskNotFound
}

func TestOrderOptionsPanic(t *testing.T) {
	locks, m := newLocks(t)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: m.Addr()})
	t.Cleanup(func() { client.Close() })
	for _, tt := range []struct {
		name, want string
		f          func()
	}{
		{"no TaskLookup", "asynqmutex.Middleware", func() { Middleware(locks, InOrder(nil)) }},
		{"OnEach", "asynqmutex.Middleware", func() { Middleware(locks, InOrder(noTasks{}), OnEach("a", "b")) }},
		{"Limit", "asynqmutex.Middleware", func() { Middleware(locks, InOrder(noTasks{}), Limit(2)) }},
		{"NoLock", "asynqmutex.Middleware", func() { Middleware(locks, InOrder(noTasks{}), Rate(1, time.Second), NoLock()) }},
		{"Skip", "asynqmutex.Middleware", func() { Middleware(locks, InOrder(noTasks{}), OnConflict(Skip)) }},
		{"OrderGrace without InOrder", "asynqmutex.Middleware", func() { Middleware(locks, OrderGrace(time.Second)) }},
		{"OrderGrace zero", "asynqmutex.OrderGrace", func() { OrderGrace(0) }},
		{"InOrder twice", "InOrder(tasks) and InOrder(tasks) both given", func() { Middleware(locks, InOrder(noTasks{}), InOrder(noTasks{})) }},
		{"producer without InOrder", "asynqmutex.NewProducer", func() { NewProducer(locks, client, On("a")) }},
		{"producer without client", "asynqmutex.NewProducer", func() { NewProducer(locks, nil, InOrder(nil)) }},
		{"producer without locks", "asynqmutex.NewProducer", func() { NewProducer(nil, client, InOrder(nil)) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			defer func() {
				r := recover()
				if r == nil || !strings.Contains(r.(string), tt.want) {
					t.Fatalf("panic %v, want one naming %s", r, tt.want)
				}
			}()
			tt.f()
		})
	}
	// A producer needs no TaskLookup.
	NewProducer(locks, client, InOrder(nil), On("a"))
}

func TestPlaceOutcome(t *testing.T) {
	withRetries := taskMeta{retried: 0, maxRetry: 3, counted: true}
	lastTry := taskMeta{retried: 3, maxRetry: 3, counted: true}
	for _, tt := range []struct {
		name   string
		err    error
		meta   taskMeta
		ended  bool
		how    order.How
		reason string
		halt   bool
	}{
		{"success", nil, withRetries, false, order.Done, "", false},
		{"failure to retry", errors.New("boom"), withRetries, false, 0, "", false},
		{"busy key", &LockedError{Key: "k"}, withRetries, false, 0, "", false},
		{"last try failed", errors.New("boom"), lastTry, false, order.Skipped, "failed", false},
		{"SkipRetry", errors.Join(errors.New("bad"), asynq.SkipRetry), withRetries, false, order.Skipped, "failed", false},
		{"RevokeTask", asynq.RevokeTask, withRetries, false, order.Skipped, "failed", false},
		{"outside asynq", errors.New("boom"), taskMeta{}, false, 0, "", false},
		{"last try cut short by shutdown", context.Canceled, lastTry, true, 0, "", false},
		{"success as the context ended", nil, lastTry, true, order.Done, "", false},
		{"last try failed, halting", errors.New("boom"), lastTry, false, order.Halted, "failed", true},
		{"SkipRetry, halting", errors.Join(errors.New("bad"), asynq.SkipRetry), withRetries, false, order.Halted, "failed", true},
		{"failure to retry, halting", errors.New("boom"), withRetries, false, 0, "", true},
		{"success, halting", nil, lastTry, false, order.Done, "", true},
	} {
		if how, reason := placeOutcome(tt.err, tt.meta, tt.ended, tt.halt); how != tt.how || reason != tt.reason {
			t.Errorf("%s: placeOutcome = %v, %q; want %v, %q", tt.name, how, reason, tt.how, tt.reason)
		}
	}
}

func TestOutOfTurnError(t *testing.T) {
	le := &LockedError{Key: `["transfer","a"]`, RetryIn: 5 * time.Second, taskType: "transfer", taskID: "t5",
		turn: &turnWait{place: 5, next: 3, holder: order.Holder{TaskID: "t3", Queue: "default"}}}
	want := `asynqmutex: task "transfer" (id t5): key ["transfer","a"]: its place 5 waits for place 3 (task "t3" in queue "default"); retry in 5s`
	if got := le.Error(); got != want {
		t.Errorf("Error() = %s, want %s", got, want)
	}
	if IsFailure(le) {
		t.Error("IsFailure(out of turn) = true, want false")
	}
	// A task waiting for its turn comes back when it asked, without jitter: tasks of
	// a key sent back together return in their order.
	for range 20 {
		if d := RetryDelay(0, le, nil); d != le.RetryIn {
			t.Fatalf("RetryDelay = %v, want RetryIn %v", d, le.RetryIn)
		}
	}
	ge := &GapError{Key: `["transfer","a"]`, Place: 3, TaskID: "t3", Queue: "default", Reason: "missing"}
	if got, want := ge.Error(), `asynqmutex: key ["transfer","a"] moved past place 3 (task "t3" in queue "default"): missing`; got != want {
		t.Errorf("GapError.Error() = %s, want %s", got, want)
	}
}

func TestProducerKeyIsTheMiddlewares(t *testing.T) {
	locks, m := newLocks(t)
	client := asynq.NewClient(asynq.RedisClientOpt{Addr: m.Addr()})
	t.Cleanup(func() { client.Close() })
	p := NewProducer(locks, client, InOrder(nil), On("account"), Scope("acct"))
	got, err := p.Key(context.Background(), asynq.NewTask("transfer", []byte(`{"account":"a-1"}`)))
	want, _ := Key("acct", `"a-1"`)
	if err != nil || got != want {
		t.Fatalf("Producer.Key = %q, %v; want %q", got, err, want)
	}
	if _, err := p.Key(context.Background(), asynq.NewTask("transfer", []byte(`{}`))); err == nil {
		t.Fatal("Producer.Key of a payload without the field = nil error")
	}
}

func TestNewTaskIDsSortByTime(t *testing.T) {
	prev := newTaskID()
	for range 100 {
		time.Sleep(time.Microsecond)
		id := newTaskID()
		if id <= prev {
			t.Fatalf("newTaskID() = %s after %s, want IDs that sort by time", id, prev)
		}
		prev = id
	}
}
