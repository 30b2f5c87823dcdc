package metrics

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/asynqmutex/asynqmutex"
	"github.com/asynqmutex/asynqmutex/internal/shortkey"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// namespace prefixes every metric's name, as "asynq" does asynq's x/metrics.
const namespace = "asynqmutex"

// DefaultMaxTaskTypes is how many distinct task_type label values a Collector keeps
// unless MaxTaskTypes says otherwise.
const DefaultMaxTaskTypes = 1000

// Other is the task_type label of events whose task type came after the first
// MaxTaskTypes distinct ones. A task type that is itself named "other" shares it.
const Other = "other"

// Option configures New. Options follow asynq's style: MaxTaskTypes(n), not
// WithMaxTaskTypes(n).
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	maxTaskTypes int
}

// MaxTaskTypes bounds the distinct values of the task_type label at n, besides "":
// the first n task types seen get a label value of their own, and every later one is
// counted under Other. A task type costs the series its events create, at most 94
// (mostly the 19 buckets of each histogram series), so lower n where the metrics
// backend is tight.
// The default is DefaultMaxTaskTypes (1000). MaxTaskTypes panics if n < 1.
func MaxTaskTypes(n int) Option {
	if n < 1 {
		panic(fmt.Sprintf("metrics.MaxTaskTypes: %d task types; want at least 1", n))
	}
	return optionFunc(func(c *config) { c.maxTaskTypes = n })
}

// Collector turns the events of mutex Clients and asynqmutex middleware into
// Prometheus metrics. Register it with a prometheus.Registerer (it is a
// prometheus.Collector), give its Observe method to every Client it should hear, with
// mutex.Observe, and its ObserveTask method to every middleware, with
// asynqmutex.Observe: one Collector may serve several of each, and their figures add
// up. Register it once per registry: a second
// Collector in the same registry fails to register, its metrics having the same
// names.
//
// Create it with New; the zero value is not usable. Its methods are safe for
// concurrent use.
type Collector struct {
	maxTaskTypes int
	taskTypes    sync.Map // label value (string) → struct{}: those admitted
	mu           sync.Mutex
	nTaskTypes   int         // guarded by mu: len(taskTypes) less ""
	full         atomic.Bool // nTaskTypes reached maxTaskTypes: new names are Other

	wait            *prometheus.HistogramVec // task_type, outcome
	hold            *prometheus.HistogramVec // task_type
	waiters         *prometheus.GaugeVec     // task_type
	contended       *prometheus.CounterVec   // task_type
	leaseLost       *prometheus.CounterVec   // task_type
	renewFailures   *prometheus.CounterVec   // task_type
	releaseFailures *prometheus.CounterVec   // task_type
	conflicts       *prometheus.CounterVec   // task_type, policy
	badInput        *prometheus.CounterVec   // task_type
	limited         *prometheus.CounterVec   // task_type, policy
	rateWait        *prometheus.HistogramVec // task_type
	pauses          *prometheus.CounterVec   // task_type
	outOfTurn       *prometheus.CounterVec   // task_type, policy
	orderSkipped    *prometheus.CounterVec   // task_type, reason
	orderStalled    *prometheus.CounterVec   // task_type, queue_read
	orderHalted     *prometheus.CounterVec   // task_type
	outOfOrder      *prometheus.CounterVec   // task_type
	parkStarted     *prometheus.CounterVec   // task_type
	parkPassedOver  *prometheus.CounterVec   // task_type
	superseded      *prometheus.CounterVec   // task_type
	wakeupLost      prometheus.Counter
	wakeupRecovered prometheus.Counter
	all             []prometheus.Collector
}

var _ prometheus.Collector = (*Collector)(nil)

// New returns a Collector with no figures yet. Series appear as events come: a task
// type's series exist once one of its events has been observed, the wake-up counters
// from the start. New panics on an invalid option (see each option).
func New(opts ...Option) *Collector {
	cfg := config{maxTaskTypes: DefaultMaxTaskTypes}
	for _, o := range opts {
		o.apply(&cfg)
	}
	// From a millisecond to ten minutes: an uncontended lock is observed with a wait
	// of 0, a task waits up to its MaxWait (or LastTryWait, 30 s), and a task holds its lock
	// as long as its handler runs (asynq's default timeout is 30 minutes; the +Inf
	// bucket has the rest).
	buckets := []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600}
	c := &Collector{
		maxTaskTypes: cfg.maxTaskTypes,
		wait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "lock_wait_seconds",
			Help:    "Time from the first attempt to take a lock to the end of the acquisition; broken down by task type and outcome (acquired, not_obtained, error).",
			Buckets: buckets,
		}, []string{"task_type", "outcome"}),
		hold: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "lock_hold_seconds",
			Help:    "Time a lock was held until its holder released it; broken down by task type.",
			Buckets: buckets,
		}, []string{"task_type"}),
		waiters: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Namespace: namespace, Name: "lock_waiters",
			Help: "Number of acquisitions waiting now for a key another holds; broken down by task type.",
		}, []string{"task_type"}),
		contended: counterVec("lock_contended_total",
			"Number of acquisitions that found their key held by another; broken down by task type.", "task_type"),
		leaseLost: counterVec("lease_lost_total",
			"Number of times a holder found its lease lost while it counted on it; broken down by task type.", "task_type"),
		renewFailures: counterVec("lease_renew_failures_total",
			"Number of lease renewals that got no answer from Redis (the lease still stood); broken down by task type.", "task_type"),
		releaseFailures: counterVec("lock_release_failures_total",
			"Number of releases that got no answer from Redis (tried again until Redis answers or the lease ends); broken down by task type.", "task_type"),
		conflicts: counterVec("task_conflicts_total",
			"Number of tasks not run because their key was busy; broken down by task type and policy (skip, fail, retry, park, archive, backlog_skip, backlog_fail).", "task_type", "policy"),
		badInput: counterVec("task_bad_input_total",
			"Number of tasks archived because no lock key could be derived from them; broken down by task type.", "task_type"),
		limited: counterVec("task_rate_limited_total",
			"Number of tasks not run because their key was at its rate limit or paused; broken down by task type and policy (skip, fail, retry, archive).", "task_type", "policy"),
		rateWait: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Namespace: namespace, Name: "task_rate_wait_seconds",
			Help:    "Time a task waited for its start under its key's rate limit before it ran (tasks that waited only); broken down by task type.",
			Buckets: buckets,
		}, []string{"task_type"}),
		pauses: counterVec("key_pauses_total",
			"Number of times a handler paused its key (asynqmutex.PauseKey); broken down by task type.", "task_type"),
		outOfTurn: counterVec("task_out_of_turn_total",
			"Number of tasks not run because an earlier task of their key had not finished (InOrder); broken down by task type and policy (skip, fail, retry, archive).", "task_type", "policy"),
		orderSkipped: counterVec("order_places_skipped_total",
			"Number of places a key moved past without their task finishing (InOrder); broken down by task type and reason (failed, archived, completed, missing, abandoned).", "task_type", "reason"),
		orderStalled: counterVec("task_order_stalled_total",
			"Number of tasks sent back behind a place whose task had been pending for longer than OrderGrace (InOrder); broken down by task type and whether a server reads that task's queue (yes, no, unknown).", "task_type", "queue_read"),
		orderHalted: counterVec("order_halts_total",
			"Number of times a key halted at a task that failed for good (InOrder, HaltOnFailure); broken down by task type.", "task_type"),
		outOfOrder: counterVec("task_out_of_order_total",
			"Number of tasks run under their lock alone, outside their key's order (InOrder): no place, or a place their key had moved past; broken down by task type.", "task_type"),
		parkStarted: counterVec("task_park_started_total",
			"Number of parked tasks started because their turn in their key's line came, or was near, or their rate start or their key's pause's end came (Park); broken down by task type.", "task_type"),
		parkPassedOver: counterVec("task_park_passed_over_total",
			"Number of parked tasks whose turn came when they no longer waited (deleted, archived, done), so that their key passed on (Park); broken down by task type, empty when asynq no longer knew the task.", "task_type"),
		superseded: counterVec("task_superseded_total",
			"Number of parked tasks deleted from asynq because a newcomer replaced them in their key's full line (MaxBacklog with OverflowReplace); broken down by task type.", "task_type"),
		wakeupLost: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "wakeup_lost_total",
			Help: "Number of times a Client's subscription connection for hand-overs broke or fell silent.",
		}),
		wakeupRecovered: prometheus.NewCounter(prometheus.CounterOpts{
			Namespace: namespace, Name: "wakeup_recovered_total",
			Help: "Number of times a Client's subscription connection for hand-overs was confirmed again after it was lost.",
		}),
	}
	c.all = []prometheus.Collector{c.wait, c.hold, c.waiters, c.contended, c.leaseLost,
		c.renewFailures, c.releaseFailures, c.conflicts, c.badInput, c.limited, c.rateWait, c.pauses,
		c.outOfTurn, c.orderSkipped, c.orderStalled, c.orderHalted, c.outOfOrder, c.parkStarted, c.parkPassedOver, c.superseded, c.wakeupLost, c.wakeupRecovered}
	return c
}

func counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help}, labels)
}

// Describe sends the descriptors of the Collector's metrics to ch, for
// prometheus.Collector. It is safe for concurrent use.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, m := range c.all {
		m.Describe(ch)
	}
}

// Collect sends the Collector's current figures to ch, for prometheus.Collector. It
// never fails and is safe for concurrent use, with Observe too.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	for _, m := range c.all {
		m.Collect(ch)
	}
}

// Observe records e in the Collector's metrics. Give it to a Client with
// mutex.Observe(c.Observe). It does not block: it takes a mutex only briefly, for
// the first event of a task type. For a lock and release of a task type seen before
// it allocates nothing and takes well under a microsecond. It never fails, ignores
// operations it does not know, and is safe for concurrent use.
//
// asynqmutex_lock_waiters counts an acquisition from its OpContended to the
// OpAcquired or OpNotObtained that ends it (marked Contended).
func (c *Collector) Observe(_ context.Context, e mutex.Event) {
	switch e.Op {
	case mutex.OpAcquired:
		t := c.taskType(e.Name)
		c.wait.WithLabelValues(t, "acquired").Observe(e.Wait.Seconds())
		c.waitEnded(e, t)
	case mutex.OpNotObtained:
		t := c.taskType(e.Name)
		outcome := "not_obtained"
		if e.Err != nil && !errors.Is(e.Err, mutex.ErrNotObtained) {
			outcome = "error"
		}
		c.wait.WithLabelValues(t, outcome).Observe(e.Wait.Seconds())
		c.waitEnded(e, t)
	case mutex.OpContended:
		t := c.taskType(e.Name)
		c.contended.WithLabelValues(t).Inc()
		c.waiters.WithLabelValues(t).Inc()
	case mutex.OpReleased:
		c.hold.WithLabelValues(c.taskType(e.Name)).Observe(e.Held.Seconds())
	case mutex.OpLeaseLost:
		c.leaseLost.WithLabelValues(c.taskType(e.Name)).Inc()
	case mutex.OpRenewFailed:
		c.renewFailures.WithLabelValues(c.taskType(e.Name)).Inc()
	case mutex.OpReleaseFailed:
		c.releaseFailures.WithLabelValues(c.taskType(e.Name)).Inc()
	case mutex.OpWakeupLost:
		c.wakeupLost.Inc()
	case mutex.OpWakeupRecovered:
		c.wakeupRecovered.Inc()
	}
}

// ObserveTask records e, an event of the asynqmutex middleware, in the Collector's
// metrics. Give it to the middleware with asynqmutex.Observe(c.ObserveTask), beside
// mutex.Observe(c.Observe) for the locks. Like Observe it does not block, never
// fails, ignores operations it does not know, and is safe for concurrent use.
func (c *Collector) ObserveTask(_ context.Context, e asynqmutex.Event) {
	switch e.Op {
	case asynqmutex.OpConflict:
		c.conflicts.WithLabelValues(c.taskType(e.TaskType), policy(e.Policy)).Inc()
	case asynqmutex.OpBadInput:
		c.badInput.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpLimited:
		c.limited.WithLabelValues(c.taskType(e.TaskType), policy(e.Policy)).Inc()
	case asynqmutex.OpRateWaited:
		c.rateWait.WithLabelValues(c.taskType(e.TaskType)).Observe(e.Wait.Seconds())
	case asynqmutex.OpPaused:
		c.pauses.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpOutOfTurn:
		c.outOfTurn.WithLabelValues(c.taskType(e.TaskType), policy(e.Policy)).Inc()
	case asynqmutex.OpOrderSkipped:
		c.orderSkipped.WithLabelValues(c.taskType(e.TaskType), gapReason(e.Err)).Inc()
	case asynqmutex.OpOutOfOrder:
		c.outOfOrder.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpOrderStalled:
		c.orderStalled.WithLabelValues(c.taskType(e.TaskType), queueRead(e.Err)).Inc()
	case asynqmutex.OpOrderHalted:
		c.orderHalted.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpParkStarted:
		c.parkStarted.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpParkPassedOver:
		c.parkPassedOver.WithLabelValues(c.taskType(e.TaskType)).Inc()
	case asynqmutex.OpSuperseded:
		c.superseded.WithLabelValues(c.taskType(e.TaskType)).Inc()
	}
}

// waitEnded takes the acquisition of e off the waiters gauge if it had contended.
func (c *Collector) waitEnded(e mutex.Event, taskType string) {
	if e.Contended {
		c.waiters.WithLabelValues(taskType).Dec()
	}
}

// queueRead says of err, an OpOrderStalled event's *StallError, whether a server
// reads the queue of the task its key waits for: "yes", "no" or "unknown".
func queueRead(err error) string {
	var se *asynqmutex.StallError
	switch {
	case !errors.As(err, &se) || se.Readers < 0:
		return "unknown"
	case se.Readers == 0:
		return "no"
	}
	return "yes"
}

// gapReason is the reason of err, an OpOrderSkipped event's *GapError, as a label
// value: one of the middleware's, or Other.
func gapReason(err error) string {
	var ge *asynqmutex.GapError
	if errors.As(err, &ge) {
		switch ge.Reason {
		case "failed", "archived", "completed", "missing", "abandoned":
			return ge.Reason
		}
	}
	return Other
}

// policy is p as a label value: one of the middleware's, or Other.
func policy(p string) string {
	switch p {
	case "skip", "fail", "retry", "park", "archive", "backlog_skip", "backlog_fail":
		return p
	}
	return Other
}

// taskType is the task_type label of an event's Name: the name as mutex.HeldBy stores
// it (as every event carries it), in valid UTF-8, while fewer than maxTaskTypes have
// been seen, and Other after that.
func (c *Collector) taskType(name string) string {
	if name == "" {
		return ""
	}
	if _, ok := c.taskTypes.Load(name); ok {
		return name
	}
	if c.full.Load() {
		return Other
	}
	name = shortkey.Field(name) // as mutex.HeldBy stores it; Prometheus requires UTF-8
	if _, ok := c.taskTypes.Load(name); ok {
		return name
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.taskTypes.Load(name); ok {
		return name
	}
	if c.nTaskTypes >= c.maxTaskTypes {
		c.full.Store(true)
		return Other
	}
	c.nTaskTypes++
	c.taskTypes.Store(name, struct{}{})
	return name
}
