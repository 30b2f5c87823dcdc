package main

import (
	"context"
	"errors"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
	"github.com/asynqmutex/asynqmutex/metrics"
	"github.com/asynqmutex/asynqmutex/mutex"
)

// The event hook's cost: mutex.Observe's doc promises that an unset observer costs
// nothing but a nil check. A no-op observer bounds that from above (it adds the call
// as well), and the metrics observer is what a user would set.
func init() {
	scenarios = append(scenarios, scenario{
		name:  "event hook: uncontended lock+unlock",
		group: hookGroup,
		metrics: []metric{
			{name: "latency", unit: "µs/op"},
			{name: ratioName("latency"), unit: "×"},
			{name: "Redis server time", unit: "µs/op"},
			{name: ratioName("Redis server time"), unit: "×"},
		},
		run: runHook,
	})
}

const (
	noObserver = "no observer"
	// The scenario runs for hookSpan × -d, in hookCycles cycles: the differences
	// sought are a percent or less, far below what load from elsewhere on a shared
	// machine does to one stretch, so each cycle's ratios are taken within it, where
	// the contenders ran close together, and the median over cycles is reported.
	hookSpan   = 3
	hookCycles = 100
	// hookMinTurn bounds a turn from below, for a short -d: a turn must hold a good
	// many operations (about 100 µs each).
	hookMinTurn = 20 * time.Millisecond
)

func ratioName(figure string) string { return figure + " ÷ " + noObserver }

// hookContenders are asynqmutex's Client three times: without an observer, with one
// that does nothing, and with a metrics.Collector's (new for every run, registered
// nowhere: a scrape is not part of a lock's cost).
func hookContenders() []contender {
	noop := func(context.Context, mutex.Event) {}
	return []contender{
		{column: column{name: noObserver}, sent: benchkit.LockCommands,
			open: openOursWith("hook-none:")},
		{column: column{name: "no-op observer"}, sent: benchkit.LockCommands,
			open: openOursWith("hook-noop:", mutex.Observe(noop))},
		{column: column{name: "metrics observer"}, sent: benchkit.LockCommands,
			open: openOursWith("hook-metrics:", mutex.Observe(metrics.New().Observe))},
	}
}

// hookGroup is the table of the hook scenario: asynqmutex alone, a column per
// observer; its figures compare with "no observer", not with a peer.
var hookGroup = &group{
	title:   "## Event hook: asynqmutex without an observer, with a no-op one, with metrics.Collector",
	columns: columnsOf(hookContenders()),
	noPeers: true,
}

// runHook runs one goroutine's lock+unlock of a free key on each contender, in turn,
// in each of hookCycles cycles (fewer for a short -d), and returns per contender the
// median over cycles of each figure and of its ratio to no observer's in the same cycle.
func runHook(ctx context.Context, e *env) (figures, error) {
	return runCycled(ctx, e, hookContenders(), []string{"latency", "Redis server time"}, noObserver)
}

// runCycled runs one goroutine's lock+unlock of a free key on each of cs, in turn, for
// hookSpan × -d in all, in hookCycles cycles (fewer for a short -d), and returns per
// contender the median over cycles of each figure and, for each of refs, of each of
// ratios over ref's in the same cycle, named figure + " ÷ " + ref.
func runCycled(ctx context.Context, e *env, cs []contender, ratios []string, refs ...string) (figures, error) {
	keys := []string{"uncontended"}
	sides := make([]side, len(cs))
	for i, c := range cs {
		s, closeSide, err := opsSides(1)(ctx, e, c, keys)
		if err != nil {
			return nil, err
		}
		defer closeSide()
		if err := s.run(ctx, time.Now().Add(50*time.Millisecond)); err != nil {
			return nil, errors.Join(errors.New(c.name+": warm-up"), err)
		}
		s.reset()
		sides[i] = s
	}
	span := hookSpan * e.d
	cycles := max(1, min(hookCycles, int(span/(hookMinTurn*time.Duration(len(sides))))))
	turn := span / time.Duration(cycles*len(sides))
	perCycle := make(map[string]map[string][]float64, len(cs)) // contender → figure → a value per cycle
	for _, c := range cs {
		perCycle[c.name] = make(map[string][]float64)
	}
	for cycle := range cycles {
		// A turn in each, starting one further each cycle: every contender takes every
		// place in a cycle as often, and never follows itself, which would spare it the
		// first-turn cost of waking its idle connection.
		for k := range sides {
			i := (cycle + k) % len(sides)
			if err := sides[i].run(ctx, time.Now().Add(turn)); err != nil {
				return nil, errors.Join(errors.New(cs[i].name), err)
			}
		}
		all := make(figures, len(cs))
		for i, s := range sides {
			all[cs[i].name] = s.figures()
			s.reset()
		}
		for c, byFigure := range withRatios(all, ratios, refs) {
			for name, v := range byFigure {
				perCycle[c][name] = append(perCycle[c][name], v)
			}
		}
	}
	figs := make(figures, len(cs))
	for c, byFigure := range perCycle {
		figs[c] = make(map[string]float64, len(byFigure))
		for name, vs := range byFigure {
			figs[c][name] = median(vs)
		}
	}
	return figs, nil
}

// withRatios is figs with, for each contender, each of ratios over ref's figure for
// each of refs, named figure + " ÷ " + ref.
func withRatios(figs figures, ratios, refs []string) figures {
	out := make(figures, len(figs))
	for c, f := range figs {
		out[c] = make(map[string]float64, len(f)+len(ratios)*len(refs))
		for name, v := range f {
			out[c][name] = v
		}
		for _, ref := range refs {
			for _, name := range ratios {
				out[c][name+" ÷ "+ref] = value(f, name) / value(figs[ref], name)
			}
		}
	}
	return out
}
