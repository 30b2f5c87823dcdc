package integration

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/hibiken/asynq"
	"github.com/redis/go-redis/v9"

	"github.com/asynqmutex/asynqmutex/internal/redistest"
)

const (
	e2eTasks   = 3000
	e2eKeys    = 50
	e2eWorkers = 3
	// e2eBound bounds the whole test. The kill comes a few seconds after the start;
	// the killed worker's tasks keep their asynq lease up to 30s after it, and asynq
	// recovers a task only once its lease ended 30s ago: about 61s after the kill a
	// replacement worker's recoverer (it runs at server start) hands them out again,
	// with a 1s retry delay. That is ~70s; the rest is slack for a loaded machine.
	e2eBound = 150 * time.Second
	// e2eQuiet is how long nothing may change before the tasks still active are taken
	// to be the killed worker's orphans: longer than MaxWait, the longest a live
	// worker's task stays active without finishing.
	e2eQuiet = 3 * time.Second
)

// TestAsynqEndToEndWithKill runs the scenario end to end: 3 worker processes
// x Concurrency 10, 3,000 tasks over 50 keys, one worker SIGKILLed after a third of
// the tasks are done. Checks, on a referee redis-server no fault touches and through
// asynq.Inspector: no two handlers of one key ever in their section at once (and
// fences strictly increasing per key), no task lost, none archived, and no retry
// counter moved except by asynq's own recovery of the killed worker's tasks.
//
// The killed worker's handlers that were inside their section never leave it: their
// occupancy would make the next holder of each key look like an overlap. Right after
// the kill (the process reaped) the parent declares the pid dead on the referee, which
// ignores anything it still receives from it, and takes back the occupancy it left.
// That is honest because each such key is still locked by the dead holder's lease
// (checked: its PTTL is > 0 at repair time), so no live handler can have entered it
// yet: any overlap still counted is real.
func TestAsynqEndToEndWithKill(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: runs 3,000 tasks on 3 worker processes and waits about 65s for asynq to recover the killed worker's tasks (30s lease + 30s recoverer cutoff)")
	}
	t.Parallel()
	testStart := time.Now()
	bound := testStart.Add(e2eBound)
	ctx := context.Background()

	lockSrv := redistest.Start(t) // asynq and the locks
	refSrv := redistest.Start(t)  // the referee; never faulted
	opt := asynq.RedisClientOpt{Addr: lockSrv.Addr()}
	rdb := lockSrv.Client(t)
	ref := refSrv.Client(t)
	insp := newInspector(t, opt)
	cli := newClient(t, opt)

	// Enqueue everything while no worker runs, pause the queue, start the workers,
	// and let them all begin at once.
	keyOf := func(n int) string { return fmt.Sprintf("k-%02d", n%e2eKeys) }
	var (
		wg      sync.WaitGroup
		errMu   sync.Mutex
		enqErrs []error
	)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := g; n < e2eTasks; n += 8 {
				body := payload(t, e2ePayload{Key: keyOf(n), N: n})
				if _, err := cli.Enqueue(asynq.NewTask(e2eTaskType, body), asynq.MaxRetry(3),
					asynq.TaskID(e2eTaskID(n)), asynq.Retention(time.Hour)); err != nil {
					errMu.Lock()
					enqErrs = append(enqErrs, fmt.Errorf("task %d: %w", n, err))
					errMu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if len(enqErrs) > 0 {
		t.Fatalf("enqueue: %d errors, first: %v", len(enqErrs), enqErrs[0])
	}
	if err := insp.PauseQueue("default"); err != nil {
		t.Fatalf("PauseQueue: %v", err)
	}
	spec := e2eWorkerSpec{Asynq: lockSrv.Addr(), Referee: refSrv.Addr()}
	workers := make([]*e2eProc, e2eWorkers)
	for i := range workers {
		workers[i] = startE2EWorker(t, fmt.Sprintf("worker %d", i), spec)
	}
	waitFor(t, 60*time.Second, "the workers' servers to start", func() (bool, string) {
		for _, w := range workers {
			if w.exited() {
				t.Fatalf("%s exited early (%v); output:\n%s", w.name, w.err, w.out.String())
			}
		}
		n, err := ref.LLen(ctx, "ready").Result()
		return err == nil && n == e2eWorkers, fmt.Sprintf("%d ready, err %v", n, err)
	})
	if err := insp.UnpauseQueue("default"); err != nil {
		t.Fatalf("UnpauseQueue: %v", err)
	}
	t0 := time.Now()
	t.Logf("setup (2 redis-servers, %d tasks enqueued, %d worker processes up): %v", e2eTasks, e2eWorkers, t0.Sub(testStart).Round(time.Millisecond))

	// Kill worker 0 once a third of the tasks are done.
	victim := workers[0]
	vpid := strconv.Itoa(victim.pid())
	waitFor(t, time.Until(bound), "a third of the tasks done", func() (bool, string) {
		n, err := ref.SCard(ctx, "done").Result()
		return err == nil && n >= e2eTasks/3, fmt.Sprintf("%d done, err %v", n, err)
	})
	victim.kill(t)
	killed := time.Now()
	raw, err := e2eRepairScript.Run(ctx, ref, []string{"inside:" + vpid, "dead", "active"}, vpid).StringSlice()
	repairedAfter := time.Since(killed)
	if err != nil {
		t.Fatalf("referee: repair after the kill: %v", err)
	}
	doneAtKill := refInt(t, ref, "done", "scard")
	lockedAtKill := refInt(t, ref, "lockederrs", "get")
	flight, err := ref.HGetAll(ctx, "flight:"+vpid).Result()
	if err != nil {
		t.Fatalf("referee: flight: %v", err)
	}
	// Each section the dead worker was in still has its lock: that is what makes the
	// repair safe (no live handler can have entered those keys yet).
	var repaired []string
	minPTTL := time.Duration(-1)
	for i := 0; i+1 < len(raw); i += 2 {
		k := raw[i+1]
		repaired = append(repaired, fmt.Sprintf("task %s on %s", raw[i], k))
		pttl, err := rdb.PTTL(ctx, redisLockKey(t, lockKey(t, e2eTaskType, k))).Result()
		if err != nil {
			t.Fatalf("PTTL of %s's lock: %v", k, err)
		}
		if pttl <= 0 {
			t.Errorf("the dead worker's section on %s was repaired %v after the kill, but its lock was already free (PTTL %v): an overlap may have been hidden", k, repairedAfter, pttl)
		}
		if minPTTL < 0 || pttl < minPTTL {
			minPTTL = pttl
		}
	}
	t.Logf("SIGKILL %s (pid %s) %v after the start, with %d tasks done: %d tasks were in its handler chain (lock wait included), %d inside their section; occupancy repaired %v after the kill %v, while their locks still had >= %v to live",
		victim.name, vpid, killed.Sub(t0).Round(time.Millisecond), doneAtKill, len(flight), len(repaired), repairedAfter.Round(time.Microsecond), repaired, minPTTL)

	// Wait until the two survivors have done everything but the dead worker's tasks:
	// nothing pending, scheduled or retrying, every task done or active, and nothing
	// changing for e2eQuiet. The active ones are then the orphans, each still under a
	// lease no one extends.
	var (
		orphans    map[string]float64 // task ID -> lease end (Unix seconds)
		lastDone   int64
		lastDoneAt = killed
		lastState  string
		stateSince = time.Now()
		timeline   []string // tasks done at each whole second after the kill
	)
	for {
		if time.Now().After(bound) {
			t.Fatalf("the survivors did not drain within the bound; last state: %s", lastState)
		}
		d := refInt(t, ref, "done", "scard")
		if d != lastDone {
			lastDone, lastDoneAt = d, time.Now()
		}
		if s := int(time.Since(killed) / time.Second); s >= len(timeline) {
			timeline = append(timeline, fmt.Sprintf("+%ds:%d", s, d))
		}
		lease, err := rdb.ZRangeWithScores(ctx, "asynq:{default}:lease", 0, -1).Result()
		if err != nil {
			t.Fatalf("reading asynq's lease set: %v", err)
		}
		q, err := insp.GetQueueInfo("default")
		if err != nil {
			t.Fatalf("GetQueueInfo: %v", err)
		}
		ids := make([]string, 0, len(lease))
		ns := make([]any, 0, len(lease))
		for _, z := range lease {
			id := z.Member.(string)
			ids = append(ids, id)
			n, _ := strconv.Atoi(strings.TrimPrefix(id, "e2e-"))
			ns = append(ns, n)
		}
		covered := d
		if len(ns) > 0 {
			in, err := ref.SMIsMember(ctx, "done", ns...).Result()
			if err != nil {
				t.Fatalf("referee: SMISMEMBER: %v", err)
			}
			for _, ok := range in {
				if !ok {
					covered++
				}
			}
		}
		slices.Sort(ids)
		state := fmt.Sprintf("done=%d active=%v pending=%d scheduled=%d retry=%d", d, ids, q.Pending, q.Scheduled, q.Retry)
		if state != lastState {
			lastState, stateSince = state, time.Now()
		}
		if q.Pending+q.Scheduled+q.Retry == 0 && covered == e2eTasks && time.Since(stateSince) >= e2eQuiet {
			orphans = make(map[string]float64, len(lease))
			for _, z := range lease {
				orphans[z.Member.(string)] = z.Score
			}
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	drained := lastDoneAt
	lockedAtDrain := refInt(t, ref, "lockederrs", "get")
	orphanIDs := make([]string, 0, len(orphans))
	var leaseEnd float64
	for id, s := range orphans {
		orphanIDs = append(orphanIDs, id)
		leaseEnd = max(leaseEnd, s)
	}
	sort.Strings(orphanIDs)
	t.Logf("survivors drained the rest %v after the kill (%v after the start); left active under the dead worker's leases: %d tasks %v",
		drained.Sub(killed).Round(time.Millisecond), drained.Sub(t0).Round(time.Millisecond), len(orphanIDs), orphanIDs)
	t.Logf("tasks done after the kill (%d at the kill), by second: %s", doneAtKill, strings.Join(timeline, " "))

	// asynq recovers a task once its lease ended >= 30s ago, at a server's start and
	// then once a minute. The survivors' next run is ~60s after they started, usually
	// a few seconds too early; a replacement worker started past the cutoff recovers
	// the orphans at once. Whichever comes first is fine.
	var replacement *e2eProc
	allDone := func() bool { return refInt(t, ref, "done", "scard") == e2eTasks }
	if len(orphanIDs) > 0 {
		recoverAt := time.Unix(int64(leaseEnd), 0).Add(asynqRecoverCutoff + time.Second)
		if recoverAt.Add(15 * time.Second).After(bound) {
			t.Fatalf("asynq would recover the orphans only at %v after the start, too close to the bound %v", recoverAt.Sub(testStart).Round(time.Second), e2eBound)
		}
		t.Logf("orphans' leases end %v after the kill; recoverable %v after it",
			time.Unix(int64(leaseEnd), 0).Sub(killed).Round(time.Second), recoverAt.Sub(killed).Round(time.Second))
		for time.Now().Before(recoverAt) && !allDone() {
			time.Sleep(200 * time.Millisecond)
		}
		if allDone() {
			t.Logf("the survivors' own recoverer handed the orphans out %v after the kill", time.Since(killed).Round(time.Second))
		} else {
			replacement = startE2EWorker(t, "replacement worker", spec)
			t.Logf("replacement worker (pid %d) started %v after the kill", replacement.pid(), time.Since(killed).Round(time.Second))
		}
	}
	waitFor(t, time.Until(bound), "every task done and completed in asynq", func() (bool, string) {
		d := refInt(t, ref, "done", "scard")
		q, err := insp.GetQueueInfo("default")
		if err != nil {
			return false, err.Error()
		}
		return d == e2eTasks && q.Completed == e2eTasks && q.Active+q.Pending+q.Scheduled+q.Retry+q.Archived == 0,
			fmt.Sprintf("done=%d completed=%d active=%d pending=%d scheduled=%d retry=%d archived=%d", d, q.Completed, q.Active, q.Pending, q.Scheduled, q.Retry, q.Archived)
	})
	finished := time.Now()

	// Stop the live workers cleanly: their exit status carries their own -race and
	// goleak verdicts.
	live := []*e2eProc{workers[1], workers[2]}
	if replacement != nil {
		live = append(live, replacement)
	}
	var stopWG sync.WaitGroup
	stopErrs := make([]error, len(live))
	for i, w := range live {
		stopWG.Add(1)
		go func() {
			defer stopWG.Done()
			stopErrs[i] = w.stop(20 * time.Second)
		}()
	}
	stopWG.Wait()
	for i, w := range live {
		if stopErrs[i] != nil {
			t.Errorf("%s (pid %d) exited with %v; output:\n%s", w.name, w.pid(), stopErrs[i], w.out.String())
		}
	}

	// --- Checks ---

	// 0 concurrent handlers per key, fences strictly increasing per key.
	overlaps := refInt(t, ref, "overlaps", "get")
	stale := refInt(t, ref, "stale", "get")
	if overlaps != 0 || stale != 0 {
		log, _ := ref.LRange(ctx, "checklog", 0, 20).Result()
		t.Errorf("referee: %d overlaps (two handlers of one key in their section at once), %d stale fences; first:\n%s", overlaps, stale, strings.Join(log, "\n"))
	}
	// The repair was exact: every section left, nothing left occupied.
	occKeys := make([]string, 0, e2eKeys+1)
	for k := range e2eKeys {
		occKeys = append(occKeys, "occ:"+keyOf(k))
	}
	occKeys = append(occKeys, "active")
	vals, err := ref.MGet(ctx, occKeys...).Result()
	if err != nil {
		t.Fatalf("referee: MGET occ: %v", err)
	}
	for i, v := range vals {
		if s, _ := v.(string); s != "" && s != "0" {
			t.Errorf("referee: %s = %s at the end, want 0", occKeys[i], s)
		}
	}
	if n := refInt(t, ref, "ignored", "get"); n != 0 {
		t.Logf("referee: %d commands arrived from the killed worker after it was declared dead (ignored)", n)
	}

	// 0 tasks lost; duplicates only among the orphans, and exactly those whose section
	// the dead worker had finished before asynq heard the task was done.
	doneList, err := ref.SMembers(ctx, "done").Result()
	if err != nil {
		t.Fatalf("referee: SMEMBERS done: %v", err)
	}
	doneSet := make(map[string]bool, len(doneList))
	for _, s := range doneList {
		doneSet[s] = true
	}
	var lost []int
	runKeys := make([]string, e2eTasks)
	for n := range e2eTasks {
		if !doneSet[strconv.Itoa(n)] {
			lost = append(lost, n)
		}
		runKeys[n] = "runs:" + strconv.Itoa(n)
	}
	if len(lost) > 0 {
		t.Errorf("%d tasks lost (never completed a section): %v", len(lost), lost[:min(len(lost), 20)])
	}
	runs, err := ref.MGet(ctx, runKeys...).Result()
	if err != nil {
		t.Fatalf("referee: MGET runs: %v", err)
	}
	victimDone, err := ref.LRange(ctx, "doneby:"+vpid, 0, -1).Result()
	if err != nil {
		t.Fatalf("referee: doneby: %v", err)
	}
	victimDid := make(map[string]bool, len(victimDone))
	for _, s := range victimDone {
		victimDid[s] = true
	}
	var dups, wantDups []string
	for n, v := range runs {
		r, _ := strconv.Atoi(fmt.Sprint(v))
		id := e2eTaskID(n)
		if r > 1 {
			dups = append(dups, fmt.Sprintf("%s x%d", id, r))
			if _, ok := orphans[id]; !ok {
				t.Errorf("task %s ran its section %d times but was not in flight at the kill", id, r)
			}
		}
		if _, ok := orphans[id]; ok && victimDid[strconv.Itoa(n)] {
			wantDups = append(wantDups, id)
		}
	}
	if len(dups) != len(wantDups) {
		t.Errorf("duplicates %v; want exactly the orphans whose section the dead worker had finished: %v", dups, wantDups)
	}

	// Via asynq: 0 archived; every task completed; Retried 0 except for orphans.
	q, err := insp.GetQueueInfo("default")
	if err != nil {
		t.Fatalf("GetQueueInfo: %v", err)
	}
	if q.Archived != 0 {
		arch, _ := insp.ListArchivedTasks("default", asynq.PageSize(20))
		var desc []string
		for _, a := range arch {
			desc = append(desc, a.ID+": "+describeTask(a))
		}
		t.Errorf("%d tasks archived: %v", q.Archived, desc)
	}
	completed := map[string]*asynq.TaskInfo{}
	for page := 1; ; page++ {
		infos, err := insp.ListCompletedTasks("default", asynq.PageSize(1000), asynq.Page(page))
		if err != nil {
			t.Fatalf("ListCompletedTasks: %v", err)
		}
		for _, info := range infos {
			completed[info.ID] = info
		}
		if len(infos) < 1000 {
			break
		}
	}
	retriedOrphans, lockedLastErr := 0, 0
	for n := range e2eTasks {
		id := e2eTaskID(n)
		info, ok := completed[id]
		if !ok {
			t.Errorf("task %s is not among asynq's completed tasks", id)
			continue
		}
		if strings.Contains(info.LastErr, heldMsg) {
			lockedLastErr++
		}
		_, orphan := orphans[id]
		switch {
		case orphan && info.Retried != 1:
			t.Errorf("orphan %s: %s; want Retried 1, from asynq's recovery (ErrLeaseExpired)", id, describeTask(info))
		case orphan:
			retriedOrphans++
		case info.Retried != 0:
			t.Errorf("task %s: %s; want Retried 0: it never failed, so a busy key must not have spent a retry", id, describeTask(info))
		}
	}

	// Positive control, after the counts above were read: the same scripts do report
	// a second holder in a section and a fence that does not increase.
	ctlKeys := []string{"occ:control", "inside:control", "active:control", "maxactive:control", "overlaps", "checklog", "dead", "fence:control", "stale", "ignored"}
	o1, err1 := e2eEnterScript.Run(ctx, ref, ctlKeys, 1, "control", "control", 7).Int64()
	o2, err2 := e2eEnterScript.Run(ctx, ref, ctlKeys, 2, "control", "control", 7).Int64()
	if err1 != nil || err2 != nil || o1 != 1 || o2 != 2 ||
		refInt(t, ref, "overlaps", "get") != overlaps+1 || refInt(t, ref, "stale", "get") != stale+1 {
		t.Errorf("positive control: two entries into one section returned %d, %d (%v, %v) and did not count one overlap and one stale fence", o1, o2, err1, err2)
	}

	// --- Report ---
	maxActive := refInt(t, ref, "maxactive", "get")
	lockedErrs := refInt(t, ref, "lockederrs", "get")
	if maxActive < 2 {
		t.Errorf("at most %d handlers ran at once over all keys, want parallelism across keys (> 1)", maxActive)
	}
	if n := refInt(t, ref, "othererrs", "get"); n != 0 {
		log, _ := ref.LRange(ctx, "errlog", 0, 20).Result()
		t.Errorf("the ErrorHandlers saw %d errors other than LockedError:\n%s", n, strings.Join(log, "\n"))
	}
	firstThird := killed.Sub(t0)
	t.Logf("total runtime %v (setup %v; processing %v); 3 workers before the kill: %d tasks in %v = %.0f tasks/s; all but the %d orphans done in %v = %.0f tasks/s overall",
		time.Since(testStart).Round(time.Millisecond), t0.Sub(testStart).Round(time.Millisecond), finished.Sub(t0).Round(time.Millisecond),
		doneAtKill, firstThird.Round(time.Millisecond), float64(doneAtKill)/firstThird.Seconds(),
		len(orphanIDs), drained.Sub(t0).Round(time.Millisecond), float64(e2eTasks-len(orphanIDs))/drained.Sub(t0).Seconds())
	t.Logf("checks: overlaps=%d stale-fences=%d lost=%d archived=%d; completed tasks with Retried>0: %d, all orphans of the kill (asynq counts its lease-expired recovery as a failure: Retried 1); duplicates (section run twice): %d %v, expected %v",
		overlaps, stale, len(lost), q.Archived, retriedOrphans, len(dups), dups, wantDups)
	t.Logf("max handlers in their section at once, all keys: %d (of %d slots); LockedErrors: %d in all (%d before the kill, %d between the kill and the drain, %d after); tasks whose last error was a LockedError yet Retried 0: %d; asynq today: processed %d, failed %d",
		maxActive, e2eWorkers*e2eConcurrency, lockedErrs, lockedAtKill, lockedAtDrain-lockedAtKill, lockedErrs-lockedAtDrain, lockedLastErr, q.Processed, q.Failed)
}

// refInt reads an integer from the referee: GET key or SCARD key.
func refInt(t testing.TB, ref *redis.Client, key, how string) int64 {
	t.Helper()
	var (
		n   int64
		err error
	)
	switch how {
	case "scard":
		n, err = ref.SCard(context.Background(), key).Result()
	default:
		n, err = ref.Get(context.Background(), key).Int64()
		if err == redis.Nil {
			return 0
		}
	}
	if err != nil {
		t.Fatalf("referee: %s %s: %v", how, key, err)
	}
	return n
}
