package asynqmutex

import (
	"container/heap"
	"context"
	"sync"
	"time"
)

// This file starts the tasks parked for a time rather than for a lock (see Park): a
// task whose rate start is reserved for later, or whose key is paused, is started by
// the process it parked on when that time comes. One loop per middleware keeps
// them in a heap by due time; it runs only while the heap holds a task, so an idle
// middleware has no goroutine and sends Redis nothing. If the process dies its
// parked tasks come back by their fallback (RetryIn).

// parksUntil reports whether task tk, refused by its key's rate limit or pause or
// sent back by its handler's PauseKey, parks until a time rather than be sent back:
// under Park, when run by an asynq server (which alone can start it again), unless
// it must not (on its last try, past a reschedule cap, or with less than
// DeadlineMargin left before its deadline), as parking says for a lock.
func (m *middleware) parksUntil(ctx context.Context, tk *task) bool {
	m.waitLeft(ctx, tk) // sets lastTry and pastCap
	if deadline, ok := ctx.Deadline(); ok && time.Until(deadline) <= DeadlineMargin {
		return false
	}
	return m.mayPark(tk)
}

// hold is how far ahead a task parks until a time: a start it reserves is due, or
// its key's pause ends, within it; beyond it the task is sent back as under
// RetryLater. Four claims (2 minutes at DefaultTTL) keep the starts a key's tasks
// hold ahead, and so those that lapse when their tasks are deleted, to a few of its
// fallbacks' worth.
func (m *middleware) hold() time.Duration { return 4 * m.claim() }

// startEarly is how long, at least, before its time a task parked until a time is
// started: an asynq server dispatches a task made pending within about a
// TaskCheckInterval (20 ms with Configure's ParkedTaskCheck) when its queue is
// empty, so that it arrives by its time; see lead for a queue that is not.
const startEarly = 50 * time.Millisecond

// lead is how long before its time a task parked until a time is started, and how
// long a task whose reserved start comes within it waits for it in its worker: the
// dispatch lag seen lately, and a half more (a task made pending joins the back of
// its queue, behind whatever waits there), at least startEarly and at most a claim.
func (m *middleware) lead() time.Duration {
	return min(max(startEarly, time.Duration(m.lag.Load())*3/2), m.claim())
}

// sawLag records how late (negative: early) a task that parked until its start came
// for it: with the lead it was started with, taken to be this process's, the
// dispatch lag, averaged over the last few. A sample is bounded by twice the average
// (at least a second), so that one task that came by its fallback moves it only so
// far. Safe for concurrent use; concurrent samples may be lost.
func (m *middleware) sawLag(late time.Duration) {
	old := time.Duration(m.lag.Load())
	sample := min(max(late+m.lead(), 0), max(2*old, time.Second))
	m.lag.Store(int64(old + (sample-old)/4))
}

// parkUntil has task tk, parked on key until due (its reserved start, its key's
// pause's end), started by this process then (lead before it when a rate gate will
// hold it back for the rest), and returns its fallback: the time
// until due in whole seconds plus the claim, so that it comes back by itself after
// its start was due if this process dies (and takes another unless it comes within
// an interval of that one; see ratelimit.Limiter.TakeAs).
func (m *middleware) parkUntil(tk *task, key string, due time.Time) time.Duration {
	start := due
	if m.rates != nil {
		start = due.Add(-m.lead())
	}
	m.due.add(start, parkedTask{key: key, ticket: ticket(tk.meta.queue, tk.meta.id)})
	return wholeSeconds(time.Until(due)) + m.claim()
}

// dueLoop starts the parked tasks of one middleware when they fall due. Its zero
// value is not usable; see newDueLoop. Safe for concurrent use.
type dueLoop struct {
	start func(context.Context, parkedTask) (gone string) // starter.start

	mu      sync.Mutex
	tasks   dueHeap
	byID    map[string]*dueTask // by ticket (or other id): a task parked again replaces its entry
	running bool                // a goroutine runs loop
	wake    chan struct{}       // an entry came first: loop looks again
}

func newDueLoop(start func(context.Context, parkedTask) string) *dueLoop {
	return &dueLoop{start: start, byID: map[string]*dueTask{}, wake: make(chan struct{}, 1)}
}

// add has p started at due, replacing what was due for p's ticket, and starts the
// loop if it was not running.
func (d *dueLoop) add(due time.Time, p parkedTask) {
	d.at(due, p.ticket, func(ctx context.Context) { d.start(ctx, p) })
}

// at has run called at due, replacing what was due under id (a ticket, or another
// name no ticket can take), and starts the loop if it was not running.
func (d *dueLoop) at(due time.Time, id string, run func(context.Context)) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.byID[id]; ok {
		e.due, e.run, e.set = due, run, time.Now()
		heap.Fix(&d.tasks, e.i)
	} else {
		e := &dueTask{due: due, id: id, run: run, set: time.Now()}
		heap.Push(&d.tasks, e)
		d.byID[id] = e
	}
	if !d.running {
		d.running = true
		go d.loop()
		return
	}
	if d.tasks[0].id == id {
		select {
		case d.wake <- struct{}{}:
		default:
		}
	}
}

// drop forgets what was due under ticket (or another id): its task came early (run by
// hand, or within its MaxWait of its start) and runs, so there is nothing to start.
func (d *dueLoop) drop(ticket string) { d.dropSetBefore(ticket, time.Time{}) }

// dropSetBefore forgets what was due under id if it was set (or set again) before
// t; any time when t is zero.
func (d *dueLoop) dropSetBefore(id string, t time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if e, ok := d.byID[id]; ok && (t.IsZero() || e.set.Before(t)) {
		heap.Remove(&d.tasks, e.i)
		delete(d.byID, id)
	}
}

// loop starts each task when it falls due, each start on a goroutine of its own (a
// start waits a while for a task still returning from its park), and returns when
// no task is left.
func (d *dueLoop) loop() {
	var timer *time.Timer
	for {
		d.mu.Lock()
		if len(d.tasks) == 0 {
			d.running = false
			d.mu.Unlock()
			if timer != nil {
				timer.Stop()
			}
			return
		}
		next := d.tasks[0]
		wait := time.Until(next.due)
		if wait <= 0 {
			heap.Pop(&d.tasks)
			delete(d.byID, next.id)
			d.mu.Unlock()
			go next.run(context.Background())
			continue
		}
		d.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(wait)
		} else {
			timer.Reset(wait)
		}
		select {
		case <-timer.C:
		case <-d.wake:
		}
	}
}

// size is how many tasks wait to be started.
func (d *dueLoop) size() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.tasks)
}

// dueTask is what is to be done at due (start a parked task, say), under id; i is
// its index in the heap.
type dueTask struct {
	due time.Time
	id  string
	run func(context.Context)
	set time.Time // when it was set, or set again
	i   int
}

// dueHeap orders dueTasks by due time, earliest first (container/heap).
type dueHeap []*dueTask

func (h dueHeap) Len() int           { return len(h) }
func (h dueHeap) Less(i, j int) bool { return h[i].due.Before(h[j].due) }
func (h dueHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].i, h[j].i = i, j
}

func (h *dueHeap) Push(x any) {
	e := x.(*dueTask)
	e.i = len(*h)
	*h = append(*h, e)
}

func (h *dueHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	return e
}

// leaseMargin is how long after a holder's lease was to end the due loop looks at
// its key: this process's clock and the Redis server's may differ by a little.
const leaseMargin = 10 * time.Millisecond

// serveTimeout bounds one look at a key whose lease ended.
const serveTimeout = 10 * time.Second

// watchLease has this process look at key's line when its holder's lease, left from
// now, ends, and hand the key to the first in line if the holder neither released it
// nor renewed it (it crashed): a task parks with nobody else to come, so without the
// look the line would wait for the parked tasks' fallback. The look (mutex's Serve,
// one script call) is repeated at each later lease end while anyone is in the line;
// a key has one such look per process, and an error ends them (the fallbacks stand),
// as does a release of the key by this process (unwatchLease): it hands the key on,
// and the next task that parks there looks again.
func (m *middleware) watchLease(key string, left time.Duration) {
	m.due.at(time.Now().Add(left+leaseMargin), leaseID(key), func(ctx context.Context) {
		ctx, cancel := context.WithTimeout(ctx, serveTimeout)
		defer cancel()
		left, waiting, err := m.locks.Serve(ctx, key, m.limitOpt, m.startWith)
		if err == nil && waiting && left >= 0 {
			m.watchLease(key, max(left, time.Second)) // a key left free with someone in line: look again later
		}
	})
}

// unwatchLease ends the look at key's line that watchLease set before released: this
// process released the key then, handing it on. A look set since (a task that parked
// behind the new holder) stays.
func (m *middleware) unwatchLease(key string, released time.Time) {
	m.due.dropSetBefore(leaseID(key), released)
}

// leaseID is the due loop's id of the look at key's line: no ticket has a NUL.
func leaseID(key string) string { return "lease\x00" + key }
