//! Multi-turn generation with tools: what the engine is given to continue a sample after a
//! turn that calls a tool (the tools, the limits, how an observation becomes tokens), what a
//! finished trajectory records, and the runner of the tool calls (at most `concurrency` at
//! once, each on a thread of its own, each given up after `timeout`).
//!
//! Token in, token out: the sampled ids are never decoded and encoded again; the observation
//! is tokenized alone and appended, with the chat template's turn markers around it, to the
//! sample's tokens (mask 0, log-prob 0), and the sample continues from its KV cache.

use anyhow::Result;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{HashMap, VecDeque};
use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::tool::{truncate, Side, ToolCall, ToolFormat, ToolResult, Tools};

/// The limits of one trajectory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnLimits {
    /// Assistant turns at most (the last one answers whatever it writes).
    pub max_turns: usize,
    /// Tool calls at most over the trajectory; calls past it are not run.
    pub max_tool_calls: usize,
    /// Tool calls of one turn at most; the turn's further calls are not run.
    pub max_parallel_calls: usize,
    /// Response tokens at most (sampled and observation tokens together).
    pub max_response_tokens: usize,
    /// How a turn calls tools (`--tool-format`): with `Code`, a closed ```` ```python ````
    /// block ends the turn as soon as its fence is sampled.
    pub format: ToolFormat,
}

impl TurnLimits {
    /// Whether a trajectory `t` with `response` tokens may still call tools after the turn
    /// that just ended (it is not its last turn, calls and room are left).
    pub(super) fn may_call(&self, t: &Trajectory, response: usize) -> bool {
        t.turns.len() + 1 < self.max_turns
            && t.calls.len() < self.max_tool_calls
            && response < self.max_response_tokens
    }

    /// The calls in a turn's `text` that run, `used` calls made before: those past
    /// --max-tool-calls or --max-parallel-calls are dropped.
    pub(super) fn calls_in(&self, text: &str, used: usize) -> Vec<Result<ToolCall, String>> {
        let mut calls = self.format.parse(text);
        calls.truncate((self.max_tool_calls - used).min(self.max_parallel_calls));
        calls
    }
}

/// The token ids an observation adds after a turn: given the turn's sampled ids (its last may
/// be the end-of-turn marker the template would write) and the contents of its calls' results.
pub type Observe<'a> = &'a (dyn Fn(&[u32], &[String]) -> Result<Vec<u32>> + Sync);

/// What a sample that calls tools is continued with.
pub struct Agent<'a> {
    pub tools: Arc<dyn Tools>,
    pub limits: TurnLimits,
    /// Calls running at once (`--tool-concurrency`).
    pub concurrency: usize,
    /// A call that has not answered after this long is given up (`--tool-timeout`).
    pub timeout: Duration,
    pub observe: Observe<'a>,
    /// Tool results longer than this many characters are cut, at that side
    /// (`--max-tool-response-chars`, verl's `max_tool_response_length`).
    pub cut: Option<(usize, Side)>,
    /// Per request, its row's tool arguments (verl's `tools_kwargs`, handed to every call of
    /// its samples); a request past the end, or null, has none.
    pub kwargs: Vec<Value>,
}

/// One tool call of a trajectory, as the `tool_calls` column records it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CallRecord {
    /// The assistant turn (0-based) that made it.
    pub turn: usize,
    /// Empty for a call the model wrote badly.
    pub name: String,
    pub arguments: Value,
    /// What the model read.
    pub result: String,
    pub seconds: f64,
    pub error: Option<String>,
}

/// What a multi-turn sample adds to its completion.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Trajectory {
    /// Per response token: 1 sampled by the model, 0 observation or template marker.
    pub mask: Vec<u8>,
    /// The text of every assistant turn (a stop string cut off).
    pub turns: Vec<String>,
    pub calls: Vec<CallRecord>,
}

/// A turn's calls handed to the tool runner: (parked id, request, turn, calls).
pub(super) type Calls = (usize, usize, usize, Vec<Result<ToolCall, String>>);

/// A turn's calls while they run: the records in call order, and how many are still out.
struct TurnCalls {
    turn: usize,
    records: Vec<Option<CallRecord>>,
    left: usize,
}

/// Runs the calls of parked samples: a queue, at most `concurrency` running, each on a thread
/// of its own (a call past its timeout is answered with an error and its thread left to end on
/// its own; its slot is free again).
pub(super) struct ToolRunner {
    tools: Arc<dyn Tools>,
    concurrency: usize,
    timeout: Duration,
    cut: Option<(usize, Side)>,
    /// Per request, its tool arguments.
    kwargs: Vec<Arc<Value>>,
    /// Queued calls: (parked id, call index, call, its request's tool arguments).
    queue: VecDeque<(usize, usize, ToolCall, Arc<Value>)>,
    /// Running calls: (parked id, call index) -> (start, call).
    running: HashMap<(usize, usize), (Instant, ToolCall)>,
    turns: HashMap<usize, TurnCalls>,
    tx: Sender<(usize, usize, ToolResult)>,
    rx: Receiver<(usize, usize, ToolResult)>,
    /// Turns whose every call has answered: (parked id, records).
    ready: Vec<(usize, Vec<CallRecord>)>,
}

impl ToolRunner {
    pub(super) fn new(agent: &Agent) -> ToolRunner {
        let (tx, rx) = channel();
        ToolRunner {
            tools: agent.tools.clone(),
            concurrency: agent.concurrency.max(1),
            timeout: agent.timeout,
            cut: agent.cut,
            kwargs: agent.kwargs.iter().cloned().map(Arc::new).collect(),
            queue: VecDeque::new(),
            running: HashMap::new(),
            turns: HashMap::new(),
            tx,
            rx,
            ready: Vec::new(),
        }
    }

    /// Turns whose calls have not all answered.
    pub(super) fn busy(&self) -> bool {
        !self.turns.is_empty()
    }

    /// Queues the calls of turn `turn` of parked sample `id` (a sample of request `req`); a
    /// call the model wrote badly is answered at once with the reason.
    pub(super) fn submit(&mut self, (id, req, turn, calls): Calls) {
        let kwargs = self.kwargs.get(req).cloned().unwrap_or_default();
        let mut t = TurnCalls {
            turn,
            records: vec![None; calls.len()],
            left: 0,
        };
        for (k, c) in calls.into_iter().enumerate() {
            match c {
                Ok(call) => {
                    t.left += 1;
                    self.queue.push_back((id, k, call, kwargs.clone()));
                }
                Err(reason) => {
                    let r = ToolResult::failed(reason, 0.0);
                    t.records[k] = Some(record(turn, String::new(), Value::Null, r));
                }
            }
        }
        self.turns.insert(id, t);
        self.close_if_done(id);
        self.start();
    }

    /// Starts queued calls while slots are free.
    fn start(&mut self) {
        while self.running.len() < self.concurrency {
            let Some((id, k, call, kwargs)) = self.queue.pop_front() else {
                return;
            };
            let (tools, tx, c) = (self.tools.clone(), self.tx.clone(), call.clone());
            std::thread::spawn(move || {
                let t0 = Instant::now();
                let mut r = tools.call(&c, &kwargs);
                r.seconds = t0.elapsed().as_secs_f64();
                // The engine may have given up on the call (timeout) or ended: nobody listens.
                let _ = tx.send((id, k, r));
            });
            self.running.insert((id, k), (Instant::now(), call));
        }
    }

    /// Takes the turns whose calls have all answered. With `wait`, first waits until at least
    /// one call answers or times out (when some run).
    pub(super) fn poll(&mut self, wait: bool) -> Vec<(usize, Vec<CallRecord>)> {
        if wait && self.ready.is_empty() {
            if let Some(deadline) = self
                .running
                .values()
                .map(|(t0, _)| *t0 + self.timeout)
                .min()
            {
                let left = deadline.saturating_duration_since(Instant::now());
                match self.rx.recv_timeout(left) {
                    Ok(m) => self.answer(m),
                    Err(RecvTimeoutError::Timeout) | Err(RecvTimeoutError::Disconnected) => {}
                }
            }
        }
        while let Ok(m) = self.rx.try_recv() {
            self.answer(m);
        }
        self.expire();
        self.start();
        std::mem::take(&mut self.ready)
    }

    /// Answers the calls past their timeout with an error.
    fn expire(&mut self) {
        let now = Instant::now();
        let late: Vec<(usize, usize)> = self
            .running
            .iter()
            .filter(|(_, (t0, _))| now.duration_since(*t0) >= self.timeout)
            .map(|(k, _)| *k)
            .collect();
        for (id, k) in late {
            let secs = self.timeout.as_secs_f64();
            let r = ToolResult::failed(format!("tool timed out after {secs} s"), secs);
            self.answer((id, k, r));
        }
    }

    /// Records the result of a running call (one given up already is ignored), cut to
    /// `--max-tool-response-chars`.
    fn answer(&mut self, (id, k, mut r): (usize, usize, ToolResult)) {
        let Some((_, call)) = self.running.remove(&(id, k)) else {
            return;
        };
        if let Some((max_chars, side)) = self.cut {
            r.content = truncate(&r.content, max_chars, side);
        }
        let t = self
            .turns
            .get_mut(&id)
            .expect("a running call has its turn");
        t.records[k] = Some(record(t.turn, call.name, call.arguments, r));
        t.left -= 1;
        self.close_if_done(id);
    }

    fn close_if_done(&mut self, id: usize) {
        if self.turns[&id].left == 0 {
            let t = self.turns.remove(&id).expect("checked");
            let records = t
                .records
                .into_iter()
                .map(|r| r.expect("answered"))
                .collect();
            self.ready.push((id, records));
        }
    }
}

fn record(turn: usize, name: String, arguments: Value, r: ToolResult) -> CallRecord {
    CallRecord {
        turn,
        name,
        arguments,
        result: r.content,
        seconds: r.seconds,
        error: r.error,
    }
}
