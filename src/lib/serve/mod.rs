//! `tandem serve`: the policy behind an OpenAI-compatible HTTP API (docs/SERVING.md), so that
//! an agent written with any client drives it, and what it did is recorded as trajectories
//! that collect into a batch file the later stages take unchanged.
//!
//! `http` reads requests and writes responses (std::net, a thread per connection); `api` is the
//! OpenAI bodies; `stream` a streamed answer's events; `worker` the generator thread that batches the requests through rollout's
//! engine; `trajectory` the token-in-token-out record of multi-turn episodes and its batch.

mod api;
mod http;
mod stream;
mod trajectory;
mod worker;

use crate::backend::ops::sample::{sample_key, SamplingParams};
use crate::bail_input;
use crate::data::ChatTemplate;
use crate::engine::paged::{Completion, GenParams, Limits, Request};
use crate::error::input_error;
use crate::model::checkpoint::ModelDir;
use crate::stage::common::{at_least, range, resolve_model, Device, ModelRef};
use crate::tokenizer::Tokenizer;
use anyhow::Result;
use api::{Caps, Reply, Sampling};
use clap::Args;
use http::{Error, Response};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::io::BufReader;
use std::net::{IpAddr, TcpListener, TcpStream};
use std::ops::Bound;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use stream::{Kind, Streamer};
use trajectory::{Trajectory, Turn};
use worker::GenJob;

#[derive(Args, Debug, Clone)]
#[command(about = "Serve the policy over an OpenAI-compatible HTTP API and record trajectories")]
pub struct ServeArgs {
    /// Model directory (HF layout) or a pointer file written by sync-weights.
    #[arg(long, value_name = "DIR")]
    pub model: PathBuf,
    /// Address to listen on. Anything but a loopback address needs --api-key.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the one taken is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Bearer token every request but /health must carry (`Authorization: Bearer KEY`).
    #[arg(long, value_name = "KEY")]
    pub api_key: Option<String>,
    /// The model's name in the API (`model` of requests, /v1/models); default: the model
    /// directory's name.
    #[arg(long, value_name = "NAME")]
    pub served_model_name: Option<String>,
    /// Where to compute: cpu, cuda (GPU 0) or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// Largest `max_tokens` a request may ask (>= 1; also the default).
    #[arg(long, default_value_t = 1024, value_parser = at_least(1usize))]
    pub max_tokens: usize,
    /// Longest prompt, in tokens after the chat template (>= 1).
    #[arg(long, default_value_t = 4096, value_parser = at_least(1usize))]
    pub max_prompt_tokens: usize,
    /// Largest `n` a request may ask (>= 1).
    #[arg(long, default_value_t = 16, value_parser = at_least(1usize))]
    pub max_n: usize,
    /// Largest request body, in bytes (>= 1); larger ones get 413.
    #[arg(long, default_value_t = 4 << 20, value_parser = at_least(1usize))]
    pub max_body_bytes: usize,
    /// Open connections at most (>= 1); more get 503.
    #[arg(long, default_value_t = 512, value_parser = at_least(1usize))]
    pub max_connections: usize,
    /// Samples decoded together at most (>= 1), as rollout's.
    #[arg(long, default_value_t = 256, value_parser = at_least(1usize))]
    pub max_num_seqs: usize,
    /// Tokens run in one engine step (>= --max-num-seqs), as rollout's.
    #[arg(long, default_value_t = 8192, value_parser = at_least(1usize))]
    pub max_batched_tokens: usize,
    /// Fraction in (0, 1] of the free GPU memory the KV pool of a batch takes, as rollout's.
    #[arg(long, default_value_t = 0.9, value_parser = range(Bound::Excluded(0.0f64), Bound::Included(1.0)))]
    pub gpu_memory_fraction: f64,
    /// Generate on the warm daemon listening at SOCKET (`tandem daemon`, or a daemon group's
    /// rank 0) with the policy it holds, instead of loading a copy here (default:
    /// $TANDEM_DAEMON when set); --device must be the daemon's.
    #[arg(long, value_name = "SOCKET")]
    pub daemon: Option<PathBuf>,
    /// Directory that `POST /trajectories/collect` writes batch files into (and the server,
    /// on SIGINT/SIGTERM, the trajectories not collected yet).
    #[arg(long, value_name = "DIR")]
    pub collect_dir: Option<PathBuf>,
}

/// How long a connection may wait for its next request (or the rest of one).
const IDLE: Duration = Duration::from_secs(120);

/// Where a streamed request's tokens go as they are drawn: `(sample, token, log-prob)`.
type Sink<'a> = dyn FnMut(&[(usize, u32, f32)]) -> Result<(), Error> + 'a;

/// Set by SIGTERM/SIGINT: stop accepting, write what is left to collect, exit.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// What every connection shares.
struct Server {
    name: String,
    model: ModelRef,
    eos: Vec<u32>,
    vocab: usize,
    tokenizer: Arc<Tokenizer>,
    /// None: the model has no chat template (only /v1/completions).
    template: Option<ChatTemplate>,
    jobs: Sender<GenJob>,
    /// The batches run on a daemon (`--daemon`).
    on_daemon: bool,
    caps: Caps,
    args: ServeArgs,
    trajectories: Mutex<BTreeMap<String, Trajectory>>,
    /// Ids of responses and seeds of requests without one.
    counter: AtomicU64,
    random: u64,
    connections: AtomicUsize,
}

/// Checks the flags, loads the model, listens, and serves until SIGINT/SIGTERM.
pub fn run(args: ServeArgs) -> Result<()> {
    let host: IpAddr = match args.host.as_str() {
        "localhost" => IpAddr::from([127, 0, 0, 1]),
        h => h
            .parse()
            .map_err(|_| input_error(format!("--host {h:?} is not an IP address")))?,
    };
    if !host.is_loopback() && args.api_key.as_deref().is_none_or(str::is_empty) {
        bail_input!("--host {host} is reachable from other machines: pass --api-key KEY (clients send `Authorization: Bearer KEY`)");
    }
    if args.max_batched_tokens < args.max_num_seqs {
        bail_input!(
            "--max-batched-tokens ({}) must be >= --max-num-seqs ({})",
            args.max_batched_tokens,
            args.max_num_seqs
        );
    }
    if let Some(d) = &args.collect_dir {
        std::fs::create_dir_all(d)
            .map_err(|e| input_error(format!("--collect-dir {}: {e}", d.display())))?;
    }
    let model = resolve_model(&args.model)?;
    let cfg = ModelDir::load_config(&model.dir)?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&model.dir)?);
    let template = ChatTemplate::from_dir(&model.dir).ok();
    let limits = Limits {
        max_num_seqs: args.max_num_seqs,
        max_batched_tokens: args.max_batched_tokens,
        gpu_memory_fraction: Some(args.gpu_memory_fraction),
        graphs: false,
        overlap: true,
    };
    let socket = crate::daemon::daemon_socket(args.daemon.as_deref());
    let engine = match &socket {
        None => worker::Engine::Local(args.device),
        Some(socket) => worker::Engine::Daemon {
            socket: socket.clone(),
            model: args.model.clone(),
            device: args.device,
        },
    };
    let jobs = worker::start(engine, model.dir.clone(), tokenizer.clone(), limits)?;
    let listener = TcpListener::bind((host, args.port)).map_err(|e| {
        input_error(format!(
            "--host {host} --port {}: cannot listen: {e}",
            args.port
        ))
    })?;
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        let dir = model.pointer.as_ref().unwrap_or(&model.dir);
        dir.file_name()
            .map_or("policy".into(), |n| n.to_string_lossy().into_owned())
    });
    let server = Arc::new(Server {
        name,
        eos: cfg.eos_token_ids.clone(),
        vocab: cfg.vocab_size,
        model,
        tokenizer,
        template,
        jobs,
        on_daemon: socket.is_some(),
        caps: Caps {
            max_tokens: args.max_tokens,
            max_n: args.max_n,
        },
        trajectories: Mutex::new(BTreeMap::new()),
        counter: AtomicU64::new(0),
        random: std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish(),
        connections: AtomicUsize::new(0),
        args,
    });
    // SAFETY: `on_signal` only stores to an atomic, which is async-signal-safe; signal(2) is
    // given valid signal numbers.
    unsafe {
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
    }
    let on = match &socket {
        None => server.args.device.to_string(),
        Some(s) => format!("the daemon at {} ({})", s.display(), server.args.device),
    };
    eprintln!(
        "serve: {} (policy_version {}) as '{}' on {on}, listening on http://{}",
        server.model.dir.display(),
        server.model.policy_version,
        server.name,
        listener.local_addr()?
    );
    accept_loop(&server, &listener)?;
    server.collect_rest()
}

fn accept_loop(server: &Arc<Server>, listener: &TcpListener) -> Result<()> {
    listener.set_nonblocking(true)?;
    while !STOP.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((stream, _)) => {
                stream.set_nonblocking(false)?;
                let s = server.clone();
                if s.connections.fetch_add(1, Ordering::SeqCst) >= s.args.max_connections {
                    let busy: Response = Error::new(
                        503,
                        format!(
                            "more than {} open connections (--max-connections)",
                            s.args.max_connections
                        ),
                    )
                    .into();
                    let _ = http::write_response(&mut &stream, &busy, true);
                    s.connections.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
                std::thread::spawn(move || {
                    s.connection(stream);
                    s.connections.fetch_sub(1, Ordering::SeqCst);
                });
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(10))
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => eprintln!("serve: accept: {e}"),
        }
    }
    Ok(())
}

/// Whether the peer of `s` closed its side (nothing sent, end of stream).
fn peer_closed(s: &TcpStream) -> bool {
    let mut b = [0u8; 1];
    if s.set_nonblocking(true).is_err() {
        return true;
    }
    let closed = matches!(s.peek(&mut b), Ok(0));
    let _ = s.set_nonblocking(false);
    closed
}

fn now_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Holds a trajectory busy while its turn runs; frees it however the turn ends.
struct Busy<'a>(&'a Server, String);

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        if let Ok(mut all) = self.0.trajectories.lock() {
            match all.get_mut(&self.1) {
                // A first turn that failed leaves no trajectory behind.
                Some(t) if t.turns.is_empty() => {
                    all.remove(&self.1);
                }
                Some(t) => t.busy = false,
                None => {}
            }
        }
    }
}

impl Server {
    /// Serves one connection's requests until it closes or a request's framing is broken.
    fn connection(&self, stream: TcpStream) {
        // An idle connection does not hold its thread (and a --max-connections seat) forever.
        if stream.set_read_timeout(Some(IDLE)).is_err() {
            return;
        }
        let Ok(read_half) = stream.try_clone() else {
            return;
        };
        let mut reader = BufReader::new(read_half);
        loop {
            let (resp, close) = match http::read_request(&mut reader, self.args.max_body_bytes) {
                Ok(None) => return,
                Err(e) => (e.into(), true),
                Ok(Some(req)) => (
                    self.handle(&req, &stream).unwrap_or_else(Response::from),
                    req.close,
                ),
            };
            if resp.was_streamed() {
                return;
            }
            if http::write_response(&mut &stream, &resp, close).is_err() || close {
                return;
            }
        }
    }

    fn handle(&self, req: &http::Request, sock: &TcpStream) -> Result<Response, Error> {
        if req.path == "/health" {
            return Ok(Response::ok(json!({"status": "ok"})));
        }
        if let Some(key) = self.args.api_key.as_deref() {
            if req.header("authorization") != Some(&format!("Bearer {key}")) {
                return Err(Error::new(
                    401,
                    "missing or wrong API key: send `Authorization: Bearer KEY`",
                ));
            }
        }
        let method = req.method.as_str();
        let path = req.path.as_str();
        let post = |f: &dyn Fn() -> Result<Value, Error>| match method {
            "POST" => f().map(Response::ok),
            _ => Err(Error::new(405, format!("{path} takes POST, not {method}"))),
        };
        let answer = |f: &dyn Fn() -> Result<Response, Error>| match method {
            "POST" => f(),
            _ => Err(Error::new(405, format!("{path} takes POST, not {method}"))),
        };
        match path {
            "/v1/models" if method == "GET" => Ok(Response::ok(self.models())),
            "/v1/chat/completions" => answer(&|| self.chat(req, sock)),
            "/v1/completions" => answer(&|| self.completion(req, sock)),
            "/trajectories" if method == "GET" => Ok(Response::ok(self.list_trajectories())),
            "/trajectories/collect" => post(&|| self.collect(req)),
            p if p.starts_with("/trajectories/") && p.ends_with("/reward") => {
                let id = &p["/trajectories/".len()..p.len() - "/reward".len()];
                post(&|| self.reward(id, req))
            }
            _ => Err(Error::new(404, format!("no route {method} {path} (routes: /health, /v1/models, /v1/chat/completions, /v1/completions, /trajectories, /trajectories/ID/reward, /trajectories/collect)"))),
        }
    }

    fn models(&self) -> Value {
        json!({"object": "list", "data": [{
            "id": self.name, "object": "model", "created": now_s(), "owned_by": "tandem",
            "root": self.model.dir.display().to_string(), "policy_version": self.model.policy_version,
            "max_model_len": self.args.max_prompt_tokens + self.args.max_tokens,
        }]})
    }

    fn check_model(&self, model: &str) -> Result<(), Error> {
        match model == self.name {
            true => Ok(()),
            false => Err(Error::new(
                404,
                format!(
                    "model '{model}' does not exist: this server serves '{}'",
                    self.name
                ),
            )),
        }
    }

    fn next_id(&self, prefix: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::SeqCst);
        format!("{prefix}-{:x}{n:x}", self.random & 0xffff_ffff)
    }

    fn chat(&self, req: &http::Request, sock: &TcpStream) -> Result<Response, Error> {
        let chat = api::parse_chat(&req.json()?, &self.caps)?;
        self.check_model(&chat.model)?;
        let Some(template) = &self.template else {
            return Err(Error::new(
                400,
                "the model has no chat template: use /v1/completions",
            ));
        };
        let traj = req
            .header("x-trajectory-id")
            .map(str::to_string)
            .or(chat.user.clone());
        let Some(id) = traj else {
            let prompt = trajectory::chat_prompt(
                template,
                &self.tokenizer,
                &chat.messages,
                &chat.tools,
                &[],
            )?;
            return self.answer(Kind::Chat, &prompt, &chat.sampling, sock, &mut |_| {});
        };
        self.chat_turn(&id, &chat, template, sock)
    }

    /// One turn of trajectory `id`: its prompt checked against the earlier turns, the reply
    /// recorded.
    fn chat_turn(
        &self,
        id: &str,
        chat: &api::ChatRequest,
        template: &ChatTemplate,
        sock: &TcpStream,
    ) -> Result<Response, Error> {
        if id.is_empty() || id.len() > 200 || id.chars().any(char::is_control) || id.contains('/') {
            return Err(Error::new(
                400,
                "a trajectory id must be 1 to 200 characters, without '/' or control characters",
            ));
        }
        if chat.sampling.n != 1 {
            return Err(Error::new(
                400,
                format!("trajectory '{id}': 'n' must be 1 (one completion continues a trajectory)"),
            ));
        }
        let temperature = self.sampling(&chat.sampling).logprob_temperature();
        let (turns, _busy) = self.claim(id, temperature)?;
        let prompt = trajectory::chat_prompt(
            template,
            &self.tokenizer,
            &chat.messages,
            &chat.tools,
            &turns,
        )?;
        trajectory::check_extends(id, &turns, &prompt)?;
        let record = &mut |samples: &[Completion]| {
            let turn = Turn::new(prompt.clone(), &samples[0]);
            let mut messages: Vec<Value> = chat
                .messages
                .iter()
                .map(|m| json!({"role": m.role, "content": m.text()}))
                .collect();
            messages.push(json!({"role": "assistant", "content": turn.text}));
            let mut all = self.trajectories.lock().expect("trajectories");
            let t = all.entry(id.to_string()).or_default();
            t.logprob_temperature = temperature;
            t.turns.push(turn);
            t.messages = Value::Array(messages);
        };
        self.answer(Kind::Chat, &prompt, &chat.sampling, sock, record)
    }

    /// Marks trajectory `id` busy (created when new) and returns its turns so far; a turn at
    /// another log-prob temperature than the earlier ones is refused.
    fn claim(&self, id: &str, temperature: f32) -> Result<(Vec<Turn>, Busy<'_>), Error> {
        let mut all = self
            .trajectories
            .lock()
            .map_err(|_| Error::new(500, "poisoned"))?;
        let t = all.entry(id.to_string()).or_default();
        if t.busy {
            return Err(Error::new(
                409,
                format!("trajectory '{id}' has a turn running: send its turns one after the other"),
            ));
        }
        if !t.turns.is_empty() && t.logprob_temperature != temperature {
            return Err(Error::new(
                400,
                format!(
                    "trajectory '{id}': temperature {temperature} differs from its earlier turns' {}",
                    t.logprob_temperature
                ),
            ));
        }
        t.busy = true;
        Ok((t.turns.clone(), Busy(self, id.to_string())))
    }

    fn completion(&self, req: &http::Request, sock: &TcpStream) -> Result<Response, Error> {
        let c = api::parse_completion(&req.json()?, &self.caps)?;
        self.check_model(&c.model)?;
        let prompt = match c.prompt {
            // Raw text gets the tokenizer's own special tokens (BOS for Llama), as rollout's.
            api::Prompt::Text(t) => self
                .tokenizer
                .encode_with_special(&t, true)
                .map_err(|e| Error::new(400, format!("{e:#}")))?,
            api::Prompt::Ids(ids) => ids,
        };
        self.answer(Kind::Completion, &prompt, &c.sampling, sock, &mut |_| {})
    }

    /// Generates `prompt`'s samples, has `record` see them, and answers: one JSON body, or
    /// with `stream` the events of `stream::Streamer` as the tokens are drawn.
    fn answer(
        &self,
        kind: Kind,
        prompt: &[u32],
        s: &Sampling,
        sock: &TcpStream,
        record: &mut dyn FnMut(&[Completion]),
    ) -> Result<Response, Error> {
        let (prefix, body): (_, fn(&Reply, &Tokenizer) -> Value) = match kind {
            Kind::Chat => ("chatcmpl", api::chat_response),
            Kind::Completion => ("cmpl", api::completion_response),
        };
        let (id, created) = (self.next_id(prefix), now_s());
        if !s.stream {
            let samples = self.generate(prompt, s, sock, None)?;
            record(&samples);
            let r = Reply {
                id: &id,
                model: &self.name,
                created,
                prompt,
                samples: &samples,
            };
            return Ok(Response::ok(body(&r, &self.tokenizer)));
        }
        if self.on_daemon {
            return Err(Error::new(
                400,
                "'stream': not served through a daemon (--daemon) yet; send stream=false",
            ));
        }
        let mut st = Streamer::new(kind, &id, &self.name, created, prompt, &self.tokenizer, s);
        let mut w = sock;
        let result = {
            let mut sink = |drawn: &[(usize, u32, f32)]| {
                st.tokens(&mut w, drawn)
                    .map_err(|_| Error::new(499, "the client went away"))
            };
            self.generate(prompt, s, sock, Some(&mut sink))
        };
        match result {
            Ok(samples) => {
                record(&samples);
                let _ = st.finish(&mut w, &samples);
            }
            Err(e) if st.started() => {
                let _ = st.fail(&mut w, &Response::from(e).body);
            }
            Err(e) => return Err(e),
        }
        Ok(Response::streamed())
    }

    fn sampling(&self, s: &Sampling) -> SamplingParams {
        SamplingParams {
            temperature: s.temperature,
            top_k: s.top_k,
            top_p: s.top_p,
        }
    }

    /// The samples of `prompt`, generated with the batch the generator runs next. A client
    /// that goes away meanwhile has its job marked gone (and cancelled with its batch).
    fn generate(
        &self,
        prompt: &[u32],
        s: &Sampling,
        sock: &TcpStream,
        mut sink: Option<&mut Sink>,
    ) -> Result<Vec<Completion>, Error> {
        if prompt.is_empty() {
            return Err(Error::new(400, "the prompt is empty after tokenization"));
        }
        if prompt.len() > self.args.max_prompt_tokens {
            return Err(Error::new(
                400,
                format!(
                    "the prompt has {} tokens, more than the server's --max-prompt-tokens {}",
                    prompt.len(),
                    self.args.max_prompt_tokens
                ),
            ));
        }
        if let Some(t) = prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return Err(Error::new(
                400,
                format!(
                    "token id {t} is outside the model's vocabulary ({})",
                    self.vocab
                ),
            ));
        }
        let sampling = self.sampling(s);
        sampling
            .validate()
            .map_err(|e| Error::new(400, e.to_string()))?;
        let seed = s.seed.unwrap_or_else(|| {
            self.random
                ^ self
                    .counter
                    .fetch_add(1, Ordering::SeqCst)
                    .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        });
        let request = Request {
            max_new: Vec::new(),
            prompt: prompt.to_vec(),
            sample_keys: (0..s.n as u64)
                .map(|k| sample_key(seed, prompt, 0, k))
                .collect(),
        };
        let params = GenParams {
            sampling,
            max_new_tokens: s.max_tokens,
            stop_token_ids: match s.ignore_eos {
                true => vec![],
                false => self.eos.clone(),
            },
            stop_strings: s.stop.clone(),
        };
        let (tx, rx) = channel();
        let (tokens, drawn) = channel();
        let gone = Arc::new(AtomicBool::new(false));
        let job = GenJob {
            request,
            params,
            gone: gone.clone(),
            reply: tx,
            tokens: sink.is_some().then_some(tokens),
        };
        self.jobs
            .send(job)
            .map_err(|_| Error::new(503, "the generator stopped"))?;
        // The tokens drawn so far go to the sink (a streamed answer); a failed write is a
        // client gone.
        let pass_on = |sink: &mut Option<&mut Sink>| -> Result<(), Error> {
            let new: Vec<_> = drawn.try_iter().collect();
            match sink {
                Some(f) if !new.is_empty() => {
                    f(&new).inspect_err(|_| gone.store(true, Ordering::SeqCst))
                }
                _ => Ok(()),
            }
        };
        let tick = Duration::from_millis(if sink.is_some() { 20 } else { 50 });
        loop {
            pass_on(&mut sink)?;
            match rx.recv_timeout(tick) {
                Ok(answer) => {
                    // The tokens before the answer are all in the channel by now.
                    pass_on(&mut sink)?;
                    return answer;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Error::new(503, "the generator stopped"))
                }
                Err(RecvTimeoutError::Timeout) if peer_closed(sock) => {
                    gone.store(true, Ordering::SeqCst);
                    return Err(Error::new(499, "the client went away"));
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    fn list_trajectories(&self) -> Value {
        let all = self.trajectories.lock().expect("trajectories");
        let list: Vec<Value> = all
            .iter()
            .map(|(id, t)| json!({"id": id, "turns": t.turns.len(), "reward": t.reward, "busy": t.busy}))
            .collect();
        json!({"object": "list", "data": list})
    }

    /// `POST /trajectories/{id}/reward`: `{"reward": R}`, optionally the `ground_truth` and
    /// `data_source` the batch row carries.
    fn reward(&self, id: &str, req: &http::Request) -> Result<Value, Error> {
        let body = req.json()?;
        let reward = body
            .get("reward")
            .and_then(Value::as_f64)
            .filter(|r| r.is_finite());
        let Some(reward) = reward else {
            return Err(Error::new(
                400,
                "the body must be {\"reward\": NUMBER} (finite)",
            ));
        };
        let text = |k: &str| match body.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(v) => Err(Error::new(400, format!("'{k}' must be a string, not {v}"))),
        };
        let (truth, source) = (text("ground_truth")?, text("data_source")?);
        let mut all = self
            .trajectories
            .lock()
            .map_err(|_| Error::new(500, "poisoned"))?;
        let Some(t) = all.get_mut(id).filter(|t| !t.turns.is_empty()) else {
            return Err(Error::new(404, format!("no trajectory '{id}' (a trajectory begins with a chat request tagged with its id)")));
        };
        t.reward = Some(reward as f32);
        t.ground_truth = truth.or(t.ground_truth.take());
        t.data_source = source.or(t.data_source.take());
        Ok(json!({"id": id, "reward": reward, "turns": t.turns.len()}))
    }

    /// Takes the trajectories that have a turn and none running, in id order.
    fn take_finished(&self) -> Vec<(String, Trajectory)> {
        let mut all = self.trajectories.lock().expect("trajectories");
        let ids: Vec<String> = all
            .iter()
            .filter(|(_, t)| !t.busy && !t.turns.is_empty())
            .map(|(k, _)| k.clone())
            .collect();
        ids.into_iter()
            .filter_map(|k| all.remove(&k).map(|t| (k, t)))
            .collect()
    }

    /// `POST /trajectories/collect` (`{"name": NAME}`, optional): writes the finished
    /// trajectories to `--collect-dir/NAME.parquet` and forgets them.
    fn collect(&self, req: &http::Request) -> Result<Value, Error> {
        let Some(dir) = &self.args.collect_dir else {
            return Err(Error::new(
                400,
                "the server has no --collect-dir to write trajectories into",
            ));
        };
        let body = match req.body.is_empty() {
            true => json!({}),
            false => req.json()?,
        };
        let name = match body.get("name") {
            None | Some(Value::Null) => self.next_id("trajectories"),
            Some(Value::String(n))
                if !n.is_empty()
                    && n.len() <= 100
                    && n.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_') =>
            {
                n.clone()
            }
            Some(v) => {
                return Err(Error::new(
                    400,
                    format!("'name' must be letters, digits, '-' or '_' (at most 100), not {v}"),
                ))
            }
        };
        let out = dir.join(format!("{name}.parquet"));
        if out.exists() {
            return Err(Error::new(
                409,
                format!("{} exists: collect under another name", out.display()),
            ));
        }
        let trajs = self.take_finished();
        if trajs.is_empty() {
            return Err(Error::new(409, "no finished trajectory to collect"));
        }
        if let Err(e) =
            trajectory::write_batch(&out, &trajs, &self.model.dir, self.model.policy_version)
        {
            // Nothing written: keep them for the next collect.
            self.trajectories
                .lock()
                .expect("trajectories")
                .extend(trajs);
            return Err(e);
        }
        let ids: Vec<&String> = trajs.iter().map(|(k, _)| k).collect();
        let scored = trajs.iter().all(|(_, t)| t.reward.is_some());
        Ok(
            json!({"path": out.display().to_string(), "rows": trajs.len(), "trajectories": ids, "score": scored}),
        )
    }

    /// On shutdown: the trajectories not collected yet, into `--collect-dir`.
    fn collect_rest(&self) -> Result<()> {
        let Some(dir) = &self.args.collect_dir else {
            return Ok(());
        };
        let trajs = self.take_finished();
        if trajs.is_empty() {
            return Ok(());
        }
        let out = dir.join(format!("{}.parquet", self.next_id("shutdown")));
        trajectory::write_batch(&out, &trajs, &self.model.dir, self.model.policy_version)
            .map_err(|e| anyhow::anyhow!("{}", e.message))?;
        eprintln!(
            "serve: wrote {} trajectories to {}",
            trajs.len(),
            out.display()
        );
        Ok(())
    }
}
