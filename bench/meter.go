package main

import (
	"context"
	"fmt"
	"strconv"
	"time"

	"github.com/asynqmutex/asynqmutex/internal/benchkit"
)

// usage is what the server and this process spent over one or more measured windows.
type usage struct {
	calls     int64            // every command the server ran, those run inside scripts included, but INFO
	usec      int64            // commandstats usec of the commands the contender sends itself
	sentCalls int64            // commandstats calls of those commands: its round trips, where it pipelines nothing
	redisCPU  time.Duration    // the server's used_cpu_user + used_cpu_sys
	goCPU     time.Duration    // this process's user + system CPU
	byName    map[string]int64 // calls, by command (INFO excluded)
}

func (u *usage) add(o usage) {
	u.calls += o.calls
	u.usec += o.usec
	u.sentCalls += o.sentCalls
	u.redisCPU += o.redisCPU
	u.goCPU += o.goCPU
	for name, n := range o.byName {
		if u.byName == nil {
			u.byName = make(map[string]int64)
		}
		u.byName[name] += n
	}
}

// meter measures one window: start reads the server's INFO commandstats and cpu and
// this process's CPU time, stop reads them again and adds the difference to a usage.
// Nothing but the contender being measured talks to the server meanwhile, so every
// call counted is the contender's (or, in the asynq scenarios, its asynq server's).
type meter struct {
	e    *env
	sent []string // see usage.usec

	cmds0     map[string]benchkit.CmdStats
	cpu0, go0 time.Duration
}

func (e *env) meter(sent []string) *meter { return &meter{e: e, sent: sent} }

func (m *meter) start(ctx context.Context) error {
	var err error
	if m.cpu0, err = m.e.redisCPU(ctx); err != nil {
		return err
	}
	if m.cmds0, err = benchkit.CommandStatsByName(ctx, m.e.stats); err != nil {
		return err
	}
	m.go0 = processCPU()
	return nil
}

// stop adds to u what the server and this process spent since start.
func (m *meter) stop(ctx context.Context, u *usage) error {
	goCPU := processCPU() - m.go0
	cmds, err := benchkit.CommandStatsByName(ctx, m.e.stats)
	if err != nil {
		return err
	}
	cpu, err := m.e.redisCPU(ctx)
	if err != nil {
		return err
	}
	d := usage{redisCPU: cpu - m.cpu0, goCPU: goCPU, byName: make(map[string]int64)}
	for name, st := range cmds {
		if n := st.Calls - m.cmds0[name].Calls; name != "info" && n > 0 { // INFO: the meter's own
			d.calls += n
			d.byName[name] = n
		}
	}
	for _, name := range m.sent {
		d.usec += cmds[name].Usec - m.cmds0[name].Usec
		d.sentCalls += cmds[name].Calls - m.cmds0[name].Calls
	}
	u.add(d)
	return nil
}

// redisCPU is the CPU time the server used so far, user and system.
func (e *env) redisCPU(ctx context.Context) (time.Duration, error) {
	info, err := e.stats.Info(ctx, "cpu").Result()
	if err != nil {
		return 0, err
	}
	var sum time.Duration
	for _, field := range []string{"used_cpu_user", "used_cpu_sys"} {
		v, ok := infoField(info, field)
		if !ok {
			return 0, fmt.Errorf("INFO cpu: no %s", field)
		}
		secs, err := strconv.ParseFloat(v, 64)
		if err != nil {
			return 0, fmt.Errorf("INFO cpu: %s: %w", field, err)
		}
		sum += time.Duration(secs * float64(time.Second))
	}
	return sum, nil
}
