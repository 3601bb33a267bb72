//! `tandem serve` end to end (the real binary, a tiny model, CPU, loopback only): responses in
//! the OpenAI shape with rollout's token ids and log-probs for the same seed, 4xx cases with the
//! server alive after each, the bearer token, trajectories checked token for token and
//! collected into a batch that score, ref-logprob, advantage and update take, a client that
//! goes away cancelling its generation, and 200 concurrent clients.

use crate::stage_util::{bin, f32_rows, i32_rows, ok, p, prompts, read, strings, tiny_model};
use serde_json::{json, Value};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{channel, Receiver};
use std::time::{Duration, Instant};

/// A running `tandem serve`, killed when dropped; its stderr lines arrive on `log`.
struct Served {
    child: Child,
    port: u16,
    log: Receiver<String>,
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(model: &Path, extra: &[&str]) -> Served {
    let mut child = Command::new(bin("tandem"))
        .args(["serve", "--model", p(model), "--port", "0"])
        .args(extra)
        .env("RAYON_NUM_THREADS", "2")
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn tandem serve");
    let (tx, log) = channel();
    let stderr = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let line = log
        .recv_timeout(Duration::from_secs(120))
        .expect("serve printed nothing");
    let port = line
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or_else(|| panic!("no port in {line:?}"));
    Served { child, port, log }
}

/// Sends raw bytes on a new connection; returns the status and the JSON body.
fn raw(port: u16, bytes: &[u8]) -> (u16, Value) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(bytes).unwrap();
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8(out).unwrap();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no response: {text:?}"));
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

fn request(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&Value>,
) -> (u16, Value) {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    req.push_str("\r\n");
    req.push_str(&body);
    raw(port, req.as_bytes())
}

fn post(port: u16, path: &str, body: &Value) -> (u16, Value) {
    request(port, "POST", path, &[], Some(body))
}

fn alive(port: u16) {
    assert_eq!(request(port, "GET", "/health", &[], None).0, 200);
}

fn model_name(model: &Path) -> String {
    model.file_name().unwrap().to_string_lossy().into_owned()
}

/// The chat response has the fields of the OpenAI schema we return, with their types.
fn check_chat_schema(v: &Value) {
    assert!(
        v["id"].is_string() && v["created"].is_u64() && v["model"].is_string(),
        "{v}"
    );
    assert_eq!(v["object"], "chat.completion");
    for c in v["choices"].as_array().unwrap() {
        assert!(c["index"].is_u64());
        assert_eq!(c["message"]["role"], "assistant");
        assert!(c["message"]["content"].is_string() || c["message"]["tool_calls"].is_array());
        assert!(["stop", "length", "tool_calls"].contains(&c["finish_reason"].as_str().unwrap()));
        let lp = c["logprobs"]["content"].as_array().unwrap();
        assert_eq!(lp.len(), c["token_ids"].as_array().unwrap().len());
        for t in lp {
            assert!(t["token"].is_string() && t["logprob"].is_f64() && t["bytes"].is_array());
        }
    }
    let u = &v["usage"];
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        u["prompt_tokens"].as_u64().unwrap() as usize,
        v["prompt_token_ids"].as_array().unwrap().len()
    );
}

fn ids(v: &Value) -> Vec<i32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap() as i32)
        .collect()
}

/// The same prompt, seed and sampling give the ids and log-probs `rollout` writes.
#[test]
fn chat_completions_give_rollouts_tokens_and_logprobs() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let data = d.path().join("p.parquet");
    prompts(&data, &["What is 2 + 3?"]);
    let out = d.path().join("r.parquet");
    let args = [
        "--model",
        p(&model),
        "--in",
        p(&data),
        "--out",
        p(&out),
        "--n",
        "3",
        "--seed",
        "11",
    ];
    ok(
        "rollout",
        &[
            &args[..],
            &[
                "--temperature",
                "0.8",
                "--top-p",
                "0.9",
                "--max-new-tokens",
                "12",
            ],
        ]
        .concat(),
    );
    let r = read(&out);
    let s = serve(&model, &[]);
    let body = json!({"model": model_name(&model), "n": 3, "seed": 11, "temperature": 0.8, "top_p": 0.9,
                      "max_tokens": 12, "messages": [{"role": "user", "content": "What is 2 + 3?"}]});
    let (status, v) = post(s.port, "/v1/chat/completions", &body);
    assert_eq!(status, 200, "{v}");
    check_chat_schema(&v);
    assert_eq!(ids(&v["prompt_token_ids"]), i32_rows(&r, "prompt_ids")[0]);
    let rollout_lps = f32_rows(&r, "rollout_logprobs");
    let texts = strings(&r, "response_text");
    for (i, c) in v["choices"].as_array().unwrap().iter().enumerate() {
        assert_eq!(
            ids(&c["token_ids"]),
            i32_rows(&r, "response_ids")[i],
            "sample {i}"
        );
        let lps: Vec<f32> = c["logprobs"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["logprob"].as_f64().unwrap() as f32)
            .collect();
        assert_eq!(lps, rollout_lps[i], "sample {i}");
        assert_eq!(c["message"]["content"].as_str().unwrap_or(""), texts[i]);
    }
    // /v1/completions on the same ids continues them the same way.
    let body = json!({"model": model_name(&model), "n": 3, "seed": 11, "temperature": 0.8, "top_p": 0.9,
                      "max_tokens": 12, "prompt": v["prompt_token_ids"]});
    let (status, c) = post(s.port, "/v1/completions", &body);
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(
        ids(&c["choices"][1]["token_ids"]),
        i32_rows(&r, "response_ids")[1]
    );
    assert_eq!(
        c["choices"][1]["logprobs"]["token_logprobs"]
            .as_array()
            .unwrap()
            .len(),
        rollout_lps[1].len()
    );
    let (status, m) = request(s.port, "GET", "/v1/models", &[], None);
    assert_eq!(status, 200);
    assert_eq!(m["data"][0]["id"], model_name(&model).as_str());
}

/// The events of a streamed answer: the status, the `data:` JSON chunks, and whether it
/// ended with `data: [DONE]`.
fn events(port: u16, path: &str, body: &Value) -> (u16, Vec<Value>, bool) {
    let body = body.to_string();
    let req = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    s.write_all(req.as_bytes()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    if status == 200 {
        assert!(head.contains("Content-Type: text/event-stream"), "{head}");
    }
    let data: Vec<&str> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let done = data.last() == Some(&"[DONE]");
    let chunks = data
        .iter()
        .filter(|d| **d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    (status, chunks, done)
}

/// `"stream": true`: server-sent events in the OpenAI shape whose chunks, put together, are
/// the answer without streaming for the same seed (token ids, log-probs, text, finish
/// reason), for chat (several samples, a stop string) and completions.
#[test]
fn streamed_answers_put_together_are_the_whole_answer() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let name = model_name(&model);
    let s = serve(&model, &[]);
    let cases = [
        (
            "/v1/chat/completions",
            json!({"model": name, "n": 2, "seed": 11, "temperature": 0.8, "max_tokens": 12,
                                        "messages": [{"role": "user", "content": "What is 2 + 3?"}]}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": name, "seed": 4, "max_tokens": 16, "stop": ["e"],
                                        "messages": [{"role": "user", "content": "Say hello"}]}),
        ),
        (
            "/v1/completions",
            json!({"model": name, "n": 2, "seed": 3, "max_tokens": 10, "prompt": "Once upon"}),
        ),
    ];
    for (path, body) in cases {
        let (status, whole) = post(s.port, path, &body);
        assert_eq!(status, 200, "{whole}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let (status, chunks, done) = events(s.port, path, &streamed);
        assert_eq!(status, 200);
        assert!(done, "no [DONE]");
        let chat = path.contains("chat");
        let object = if chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        assert!(chunks
            .iter()
            .all(|c| c["object"] == object && c["id"] == chunks[0]["id"]));
        assert_eq!(chunks[0]["prompt_token_ids"], whole["prompt_token_ids"]);
        for (k, want) in whole["choices"].as_array().unwrap().iter().enumerate() {
            let mine: Vec<&Value> = chunks
                .iter()
                .map(|c| &c["choices"][0])
                .filter(|c| c["index"] == k)
                .collect();
            assert!(mine.len() > 1, "sample {k}: {} chunks", mine.len());
            let ids: Vec<Value> = mine
                .iter()
                .flat_map(|c| c["token_ids"].as_array().unwrap().clone())
                .collect();
            assert_eq!(Value::Array(ids), want["token_ids"], "{path} sample {k}");
            let (lps, text, want_lps, want_text) = match chat {
                true => (
                    mine.iter()
                        .flat_map(|c| {
                            c["logprobs"]["content"]
                                .as_array()
                                .unwrap()
                                .iter()
                                .map(|t| t["logprob"].clone())
                        })
                        .collect::<Vec<_>>(),
                    mine.iter()
                        .map(|c| c["delta"]["content"].as_str().unwrap_or(""))
                        .collect::<String>(),
                    want["logprobs"]["content"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|t| t["logprob"].clone())
                        .collect::<Vec<_>>(),
                    want["message"]["content"]
                        .as_str()
                        .unwrap_or("")
                        .to_string(),
                ),
                false => (
                    mine.iter()
                        .flat_map(|c| c["logprobs"]["token_logprobs"].as_array().unwrap().clone())
                        .collect(),
                    mine.iter()
                        .map(|c| c["text"].as_str().unwrap())
                        .collect::<String>(),
                    want["logprobs"]["token_logprobs"]
                        .as_array()
                        .unwrap()
                        .clone(),
                    want["text"].as_str().unwrap().to_string(),
                ),
            };
            assert_eq!(lps, want_lps, "{path} sample {k}");
            assert_eq!(text, want_text, "{path} sample {k}");
            let last = mine.last().unwrap();
            assert_eq!(last["finish_reason"], want["finish_reason"]);
            assert!(mine[..mine.len() - 1]
                .iter()
                .all(|c| c["finish_reason"].is_null()));
            if chat {
                assert_eq!(mine[0]["delta"]["role"], "assistant");
            }
        }
    }
    // A streamed turn of a trajectory is recorded as any turn.
    let body = json!({"model": name, "seed": 1, "max_tokens": 6, "user": "streamed", "stream": true,
                      "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, done) = events(s.port, "/v1/chat/completions", &body);
    assert!(status == 200 && done);
    let (_, list) = request(s.port, "GET", "/trajectories", &[], None);
    assert_eq!(list["data"][0]["id"], "streamed");
    assert_eq!(list["data"][0]["turns"], 1);
    // A client that goes away mid-stream cancels its generation.
    drop(s);
    let s = serve(&model, &["--max-tokens", "3000"]);
    let body = json!({"model": name, "prompt": "hello", "max_tokens": 3000, "ignore_eos": true, "stream": true}).to_string();
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut first = [0u8; 64];
    c.read_exact(&mut first).unwrap();
    assert!(String::from_utf8_lossy(&first).starts_with("HTTP/1.1 200"));
    drop(c);
    let line = loop {
        let line = s
            .log
            .recv_timeout(Duration::from_secs(60))
            .expect("no cancellation logged");
        if line.contains("cancelled") {
            break line;
        }
    };
    assert!(line.contains("every client went away"), "{line}");
    alive(s.port);
}

/// `--daemon`: the batches go to the warm daemon, which generates with the policy it holds;
/// the token ids, log-probs and texts are the in-process server's for the same requests, and
/// the server loads no model of its own. A missing daemon is an input error.
#[test]
fn serving_through_the_daemon_gives_the_in_process_servers_samples() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let name = model_name(&model);
    let bodies = [
        json!({"model": name, "n": 3, "seed": 11, "temperature": 0.8, "top_p": 0.9, "max_tokens": 12,
               "messages": [{"role": "user", "content": "What is 2 + 3?"}]}),
        json!({"model": name, "seed": 5, "max_tokens": 9, "stop": ["a"],
               "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}),
    ];
    let completion = json!({"model": name, "n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 7,
                            "prompt": "Once upon a time"});
    let answers = |port: u16| {
        let mut out: Vec<Value> = bodies
            .iter()
            .map(|b| post(port, "/v1/chat/completions", b))
            .map(|(status, v)| {
                assert_eq!(status, 200, "{v}");
                v
            })
            .collect();
        let (status, v) = post(port, "/v1/completions", &completion);
        assert_eq!(status, 200, "{v}");
        out.push(v);
        out
    };
    let here = answers(serve(&model, &[]).port);
    let sock = d.path().join("d.sock");
    let missing = Command::new(bin("tandem"))
        .args([
            "serve",
            "--model",
            p(&model),
            "--port",
            "0",
            "--daemon",
            p(&sock),
        ])
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("cannot connect"));
    let daemon = crate::daemon::Daemon::start(d.path(), &sock, p(&model), &[]);
    let s = serve(&model, &["--daemon", p(&sock)]);
    let there = answers(s.port);
    let samples = |v: &Value| -> Vec<(Value, Value, Value)> {
        let choices = v["choices"].as_array().unwrap();
        choices
            .iter()
            .map(|c| {
                let text = match &c["message"] {
                    Value::Null => c["text"].clone(),
                    m => m["content"].clone(),
                };
                (c["token_ids"].clone(), c["logprobs"].clone(), text)
            })
            .collect()
    };
    for (a, b) in here.iter().zip(&there) {
        assert_eq!(a["prompt_token_ids"], b["prompt_token_ids"]);
        assert_eq!(samples(a), samples(b));
        assert!(!samples(a).is_empty());
    }
    // Each request was a job of the daemon.
    assert_eq!(daemon.status()["jobs_done"], 3);
    let mut streamed = bodies[0].clone();
    streamed["stream"] = json!(true);
    let (status, v) = post(s.port, "/v1/chat/completions", &streamed);
    assert_eq!(status, 400);
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("not served through a daemon"));
}

/// Malformed and refused requests get their 4xx with a JSON error, and the server answers the
/// next request after each.
#[test]
fn bad_requests_get_4xx_and_the_server_keeps_serving() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let s = serve(&model, &["--max-body-bytes", "2000", "--max-tokens", "16"]);
    let name = model_name(&model);
    let user = json!([{"role": "user", "content": "hi"}]);
    let cases: Vec<(u16, (u16, Value))> = vec![
        (400, raw(s.port, b"NONSENSE\r\n\r\n")),
        (505, raw(s.port, b"GET / HTTP/3\r\n\r\n")),
        (411, raw(s.port, b"POST /v1/completions HTTP/1.1\r\n\r\n")),
        (
            413,
            raw(
                s.port,
                format!(
                    "POST /v1/completions HTTP/1.1\r\nContent-Length: 5000\r\n\r\n{}",
                    "x".repeat(5000)
                )
                .as_bytes(),
            ),
        ),
        (
            400,
            raw(
                s.port,
                b"POST /v1/chat/completions HTTP/1.1\r\nConnection: close\r\nContent-Length: 5\r\n\r\n{bad}",
            ),
        ),
        (404, request(s.port, "GET", "/v2/nothing", &[], None)),
        (
            405,
            request(s.port, "GET", "/v1/chat/completions", &[], None),
        ),
        (
            404,
            post(
                s.port,
                "/v1/chat/completions",
                &json!({"model": "gpt-9", "messages": user}),
            ),
        ),
        (
            400,
            post(
                s.port,
                "/v1/chat/completions",
                &json!({"model": name, "messages": user, "max_tokens": 17}),
            ),
        ),
        (
            400,
            post(
                s.port,
                "/v1/chat/completions",
                &json!({"model": name, "messages": "hi"}),
            ),
        ),
        (
            400,
            post(
                s.port,
                "/v1/completions",
                &json!({"model": name, "prompt": [100000]}),
            ),
        ),
        (
            404,
            post(s.port, "/trajectories/nope/reward", &json!({"reward": 1})),
        ),
        (400, post(s.port, "/trajectories/collect", &json!({}))),
    ];
    for (i, (want, (status, body))) in cases.into_iter().enumerate() {
        assert_eq!(status, want, "case {i}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "case {i}: {body}"
        );
        alive(s.port);
    }
    // Two requests on one keep-alive connection, the second after a bad body.
    let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
    c.write_all(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}GET /health HTTP/1.1\r\nConnection: close\r\n\r\n").unwrap();
    let mut text = String::new();
    c.read_to_string(&mut text).unwrap();
    assert!(text.starts_with("HTTP/1.1 400 "), "{text}");
    assert!(text.contains("HTTP/1.1 200 OK"), "{text}");
}

/// Not on loopback without a token: refused at start. With a token: 401 without it.
#[test]
fn a_bearer_token_guards_the_api() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    crate::stage_util::input_error(
        "tandem",
        &["serve", "--model", p(&model), "--host", "0.0.0.0"],
        "--api-key",
    );
    let s = serve(&model, &["--api-key", "sekret"]);
    assert_eq!(request(s.port, "GET", "/v1/models", &[], None).0, 401);
    assert_eq!(
        request(
            s.port,
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer nope")],
            None
        )
        .0,
        401
    );
    assert_eq!(
        request(
            s.port,
            "GET",
            "/v1/models",
            &[("Authorization", "Bearer sekret")],
            None
        )
        .0,
        200
    );
    alive(s.port);
}

/// A client that closes its connection mid-generation has its batch cancelled, in the server
/// and, through `--daemon`, on the daemon.
#[test]
fn a_client_that_goes_away_cancels_its_generation() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let sock = d.path().join("d.sock");
    let daemon = crate::daemon::Daemon::start(d.path(), &sock, p(&model), &[]);
    for extra in [&[][..], &["--daemon", p(&sock)][..]] {
        let s = serve(&model, &[&["--max-tokens", "3000"][..], extra].concat());
        let body = json!({"model": model_name(&model), "prompt": "hello", "max_tokens": 3000, "ignore_eos": true, "n": 4}).to_string();
        let mut c = TcpStream::connect(("127.0.0.1", s.port)).unwrap();
        write!(
            c,
            "POST /v1/completions HTTP/1.1\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        std::thread::sleep(Duration::from_millis(300));
        drop(c);
        let started = Instant::now();
        let line = loop {
            let line = s
                .log
                .recv_timeout(Duration::from_secs(60))
                .expect("no cancellation logged");
            if line.contains("cancelled") {
                break line;
            }
        };
        assert!(line.contains("every client went away"), "{line}");
        assert!(started.elapsed() < Duration::from_secs(30));
        alive(s.port);
    }
    let t0 = Instant::now();
    while daemon.status()["jobs_cancelled"] != 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{}",
            daemon.status()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// 200 clients at once, each answered (the requests batch together).
#[test]
fn two_hundred_concurrent_clients_are_all_answered() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let s = serve(&model, &[]);
    let name = model_name(&model);
    let started = Instant::now();
    let handles: Vec<_> = (0..200)
        .map(|i| {
            let (port, name) = (s.port, name.clone());
            std::thread::spawn(move || {
                let body = json!({"model": name, "max_tokens": 4, "seed": i,
                                  "messages": [{"role": "user", "content": format!("question {i}")}]});
                post(port, "/v1/chat/completions", &body)
            })
        })
        .collect();
    for h in handles {
        let (status, v) = h.join().unwrap();
        assert_eq!(status, 200, "{v}");
        assert!(!v["choices"][0]["token_ids"].as_array().unwrap().is_empty());
    }
    assert!(
        started.elapsed() < Duration::from_secs(240),
        "{:?}",
        started.elapsed()
    );
}

/// Two turns of a trajectory with a tool result between them, one trajectory re-rendered
/// (refused with the position), rewards posted, and the collected batch through score,
/// ref-logprob, advantage and update.
#[test]
fn trajectories_are_checked_and_collected_into_a_trainable_batch() {
    let d = tempfile::tempdir().unwrap();
    let model = tiny_model(d.path(), 3);
    let collect = d.path().join("collected");
    let s = serve(&model, &["--collect-dir", p(&collect)]);
    let name = model_name(&model);
    let chat = |id: &str, messages: &Value, seed: u64| {
        let body = json!({"model": name, "messages": messages, "max_tokens": 6, "seed": seed, "temperature": 1.0});
        request(
            s.port,
            "POST",
            "/v1/chat/completions",
            &[("X-Trajectory-Id", id)],
            Some(&body),
        )
    };
    for (k, id) in ["a", "b", "c"].into_iter().enumerate() {
        let mut messages = json!([{"role": "user", "content": "What is 6 * 7?"}]);
        let (status, v) = chat(id, &messages, k as u64);
        assert_eq!(status, 200, "{v}");
        let first: Vec<i32> = [
            ids(&v["prompt_token_ids"]),
            ids(&v["choices"][0]["token_ids"]),
        ]
        .concat();
        let reply = v["choices"][0]["message"].clone();
        messages
            .as_array_mut()
            .unwrap()
            .extend([reply, json!({"role": "user", "content": "Sure?"})]);
        let (status, v2) = chat(id, &messages, 10 + k as u64);
        assert_eq!(status, 200, "{v2}");
        // Token in, token out: the second prompt begins with the first prompt + completion.
        assert_eq!(ids(&v2["prompt_token_ids"])[..first.len()], first[..]);
        if id == "b" {
            // One log-prob temperature per trajectory.
            let body =
                json!({"model": name, "messages": messages, "max_tokens": 6, "temperature": 0.5});
            let (status, e) = request(
                s.port,
                "POST",
                "/v1/chat/completions",
                &[("X-Trajectory-Id", id)],
                Some(&body),
            );
            assert_eq!(status, 400, "{e}");
            assert!(
                e["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains("temperature 0.5"),
                "{e}"
            );
        }
        if id == "c" {
            // Re-rendered differently: the earlier reply's text changed.
            messages[1]["content"] = json!("something else");
            let (status, e) = chat(id, &messages, 20);
            assert_eq!(status, 409, "{e}");
            let at = ids(&v["prompt_token_ids"]).len();
            assert!(
                e["error"]["message"]
                    .as_str()
                    .unwrap()
                    .contains(&format!("first difference at position {at}")),
                "{e}"
            );
            continue;
        }
        let (status, r) = post(
            s.port,
            &format!("/trajectories/{id}/reward"),
            &json!({"reward": k as f64, "ground_truth": "42"}),
        );
        assert_eq!(status, 200, "{r}");
    }
    // "c" has no reward: no row gets a score column (`score` computes it).
    let (status, c) = post(s.port, "/trajectories/collect", &json!({"name": "step0"}));
    assert_eq!(status, 200, "{c}");
    assert_eq!(c["rows"], 3);
    assert_eq!(c["score"], false);
    let out = collect.join("step0.parquet");
    let b = read(&out);
    assert_eq!(strings(&b, "uid"), ["a", "b", "c"]);
    let mask = b.ragged_u8("response_mask").unwrap();
    let resp = i32_rows(&b, "response_ids");
    let lps = f32_rows(&b, "rollout_logprobs");
    for i in 0..3 {
        let m = mask.row(i);
        assert_eq!(m.len(), resp[i].len());
        assert!(m.contains(&0) && m[0] == 1, "row {i}: {m:?}");
        for (j, &x) in m.iter().enumerate() {
            assert_eq!(x == 0, lps[i][j] == 0.0, "row {i}, token {j}");
        }
    }
    let f = |n: &str| d.path().join(n);
    ok(
        "score",
        &[
            "--in",
            p(&out),
            "--out",
            p(&f("s.parquet")),
            "--reward",
            "exact",
        ],
    );
    ok(
        "ref-logprob",
        &[
            "--model",
            p(&model),
            "--in",
            p(&f("s.parquet")),
            "--out",
            p(&f("ref.parquet")),
            "--column",
            "ref_logprobs",
        ],
    );
    let refs = f32_rows(&read(&f("ref.parquet")), "ref_logprobs");
    // The policy's own log-probs of its tokens match the served ones (CPU: same kernels).
    for (i, row) in refs.iter().enumerate() {
        for (j, (&a, &b)) in row.iter().zip(&lps[i]).enumerate() {
            if mask.row(i)[j] == 1 {
                assert!((a - b).abs() < 1e-3, "row {i}, token {j}: {a} vs {b}");
            }
        }
    }
    ok(
        "advantage",
        &[
            "--in",
            p(&f("ref.parquet")),
            "--out",
            p(&f("adv.parquet")),
            "--estimator",
            "grpo",
        ],
    );
    ok(
        "update",
        &[
            "--model",
            p(&model),
            "--in",
            p(&f("adv.parquet")),
            "--out-model",
            p(&f("next")),
            "--lr",
            "0.001",
        ],
    );
    assert!(f("next").join("model.safetensors").is_file());
}
