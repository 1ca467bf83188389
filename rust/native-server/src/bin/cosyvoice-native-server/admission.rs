//! Synthesis slots as `cosyvoice/admission.py` hands them out: at most `max_sessions` requests synthesise,
//! up to `max_queued_requests` wait in arrival order for `queue_timeout_seconds`, everyone else is busy at
//! once; after `close` (the drain) nothing new gets in. The refusals are the Python service's.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

const SHUTTING_DOWN: &str = "shutting down: this server takes no new requests; retry on another";

#[derive(Default)]
struct State {
    active: usize,
    queue: VecDeque<u64>,
    next_ticket: u64,
    closed: bool,
}

pub struct Admission {
    max_active: usize,
    max_waiting: usize,
    timeout: Duration,
    state: Mutex<State>,
    changed: Condvar,
}

impl Admission {
    pub fn new(max_active: usize, max_waiting: usize, timeout: Duration) -> Admission {
        Admission { max_active, max_waiting, timeout, state: Mutex::default(), changed: Condvar::new() }
    }

    /// Waits (blocking) for a slot; `Err` is the busy or shutting-down refusal.
    pub fn acquire(&self) -> Result<(), String> {
        let mut state = self.state.lock().unwrap();
        if state.closed {
            return Err(SHUTTING_DOWN.into());
        }
        if state.active < self.max_active && state.queue.is_empty() {
            state.active += 1;
            return Ok(());
        }
        if state.queue.len() >= self.max_waiting {
            return Err(format!(
                "busy: {} requests are synthesising and {} are waiting; retry later",
                state.active,
                state.queue.len()
            ));
        }
        let ticket = state.next_ticket;
        state.next_ticket += 1;
        state.queue.push_back(ticket);
        let deadline = Instant::now() + self.timeout;
        loop {
            let first = state.queue.front() == Some(&ticket);
            if state.closed || (first && state.active < self.max_active) || Instant::now() >= deadline {
                state.queue.retain(|t| *t != ticket);
                self.changed.notify_all();
                if state.closed {
                    return Err(SHUTTING_DOWN.into());
                }
                if first && state.active < self.max_active {
                    state.active += 1;
                    return Ok(());
                }
                return Err(format!(
                    "busy: no synthesis slot became free within {} s; retry later",
                    crate::settings::format_g(self.timeout.as_secs_f64())
                ));
            }
            state = self.changed.wait_timeout(state, deadline - Instant::now()).unwrap().0;
        }
    }

    pub fn release(&self) {
        self.state.lock().unwrap().active -= 1;
        self.changed.notify_all();
    }

    /// Refuses every new request and wakes the waiting ones (they are refused too).
    pub fn close(&self) {
        self.state.lock().unwrap().closed = true;
        self.changed.notify_all();
    }

    /// (synthesising, waiting)
    pub fn load(&self) -> (usize, usize) {
        let state = self.state.lock().unwrap();
        (state.active, state.queue.len())
    }
}
