//! A small HTTP/1.1 server side on std::net: one request read from a buffered stream (request
//! line, headers, a `Content-Length` body), one response written back. Keep-alive is the
//! HTTP/1.1 default; a request whose framing is broken gets its 4xx and the connection is
//! closed (nothing after it can be trusted), a request that is only wrong in its content
//! (bad JSON, unknown route) gets its 4xx and the connection stays usable.
//!
//! Every error is answered in the OpenAI shape, `{"error": {"message", "type", "code"}}`, so
//! the `openai` client shows the message.

use serde_json::{json, Value};
use std::io::{BufRead, Write};

/// Bytes of the request line and headers together at most.
const MAX_HEAD: usize = 16 * 1024;
/// Headers of one request at most.
const MAX_HEADERS: usize = 100;

/// One request as read from the connection.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) method: String,
    /// The path without its query string.
    pub(crate) path: String,
    headers: Vec<(String, String)>,
    pub(crate) body: Vec<u8>,
    /// HTTP/1.0, or `Connection: close`: the connection ends after the answer.
    pub(crate) close: bool,
}

impl Request {
    /// A header's value (names compare case-insensitively).
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The body as a JSON value (400 when it is not JSON).
    pub(crate) fn json(&self) -> Result<Value, Error> {
        serde_json::from_slice(&self.body)
            .map_err(|e| Error::new(400, format!("the body is not valid JSON: {e}")))
    }
}

/// A request the server refuses: the status and the message of the JSON error body.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Error {
    pub(crate) status: u16,
    pub(crate) message: String,
}

impl Error {
    pub(crate) fn new(status: u16, message: impl Into<String>) -> Error {
        Error {
            status,
            message: message.into(),
        }
    }
}

/// A response: status, JSON body and extra headers.
#[derive(Debug)]
pub(crate) struct Response {
    pub(crate) status: u16,
    pub(crate) body: Value,
    pub(crate) headers: Vec<(&'static str, String)>,
}

impl Response {
    pub(crate) fn ok(body: Value) -> Response {
        Response {
            status: 200,
            body,
            headers: vec![],
        }
    }

    /// The answer was streamed on the connection already (`super::stream`), which then
    /// closes.
    pub(crate) fn streamed() -> Response {
        Response {
            status: 0,
            body: Value::Null,
            headers: vec![],
        }
    }

    pub(crate) fn was_streamed(&self) -> bool {
        self.status == 0
    }
}

impl From<Error> for Response {
    fn from(e: Error) -> Response {
        let kind = match e.status {
            401 => "authentication_error",
            404 => "not_found_error",
            409 => "conflict_error",
            413 => "request_too_large",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        };
        let mut r = Response {
            status: e.status,
            body: json!({"error": {"message": e.message, "type": kind, "code": e.status}}),
            headers: vec![],
        };
        if e.status == 401 {
            r.headers.push(("WWW-Authenticate", "Bearer".into()));
        }
        r
    }
}

/// Reads one request. `Ok(None)`: the peer closed the connection before a new request began.
/// An `Err` is a framing error: answer it, then close the connection.
pub(crate) fn read_request(
    r: &mut impl BufRead,
    max_body: usize,
) -> Result<Option<Request>, Error> {
    let mut head = 0usize;
    let Some(line) = read_line(r, &mut head)? else {
        return Ok(None);
    };
    let parts: Vec<&str> = line.split(' ').collect();
    let [method, target, version] = parts[..] else {
        return Err(Error::new(400, format!("malformed request line {line:?}")));
    };
    if !method.bytes().all(|b| b.is_ascii_uppercase())
        || method.is_empty()
        || !target.starts_with('/')
    {
        return Err(Error::new(400, format!("malformed request line {line:?}")));
    }
    let http10 = match version {
        "HTTP/1.1" => false,
        "HTTP/1.0" => true,
        _ => {
            return Err(Error::new(
                505,
                format!("unsupported HTTP version {version:?}"),
            ))
        }
    };
    let mut headers = Vec::new();
    loop {
        let Some(line) = read_line(r, &mut head)? else {
            return Err(Error::new(400, "the connection closed inside the headers"));
        };
        if line.is_empty() {
            break;
        }
        let Some((name, value)) = line.split_once(':') else {
            return Err(Error::new(400, format!("malformed header line {line:?}")));
        };
        if headers.len() == MAX_HEADERS {
            return Err(Error::new(431, format!("more than {MAX_HEADERS} headers")));
        }
        headers.push((name.trim().to_string(), value.trim().to_string()));
    }
    let mut req = Request {
        method: method.to_string(),
        path: target.split('?').next().unwrap_or("/").to_string(),
        headers,
        body: Vec::new(),
        close: http10,
    };
    if let Some(c) = req.header("connection") {
        req.close =
            c.eq_ignore_ascii_case("close") || (http10 && !c.eq_ignore_ascii_case("keep-alive"));
    }
    if req.header("transfer-encoding").is_some() {
        return Err(Error::new(
            501,
            "Transfer-Encoding is not supported: send a Content-Length body",
        ));
    }
    let len = match req.header("content-length") {
        None if req.method == "POST" || req.method == "PUT" => {
            return Err(Error::new(411, "a POST needs a Content-Length header"))
        }
        None => 0,
        Some(v) => v
            .parse::<usize>()
            .map_err(|_| Error::new(400, format!("Content-Length {v:?} is not a byte count")))?,
    };
    if len > max_body {
        return Err(Error::new(
            413,
            format!(
                "the body has {len} bytes, more than the limit of {max_body} (--max-body-bytes)"
            ),
        ));
    }
    req.body = vec![0u8; len];
    r.read_exact(&mut req.body).map_err(|_| {
        Error::new(
            400,
            format!("the body ended before its Content-Length of {len} bytes"),
        )
    })?;
    Ok(Some(req))
}

/// One CRLF (or LF) terminated line of the head, counted against [`MAX_HEAD`]. `None` at a
/// clean end of stream before any byte of the line.
fn read_line(r: &mut impl BufRead, head: &mut usize) -> Result<Option<String>, Error> {
    let mut buf = Vec::new();
    let limit = (MAX_HEAD - *head) as u64 + 1;
    let n = match std::io::Read::take(&mut *r, limit).read_until(b'\n', &mut buf) {
        Ok(n) => n,
        // An idle keep-alive connection timed out: closed like one the peer closed.
        Err(e) if *head == 0 && buf.is_empty() && is_timeout(&e) => return Ok(None),
        Err(e) => return Err(Error::new(400, format!("reading the request: {e}"))),
    };
    *head += n;
    if n == 0 {
        return Ok(None);
    }
    if *head > MAX_HEAD {
        return Err(Error::new(
            431,
            format!("the request line and headers exceed {MAX_HEAD} bytes"),
        ));
    }
    if buf.pop() != Some(b'\n') {
        return Err(Error::new(
            400,
            "the connection closed inside the request head",
        ));
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    String::from_utf8(buf)
        .map(Some)
        .map_err(|_| Error::new(400, "the request head is not UTF-8"))
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        499 => "Client Closed Request",
        500 => "Internal Server Error",
        501 => "Not Implemented",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Status",
    }
}

/// Writes `resp` with its JSON body; `close` says the connection ends after it.
pub(crate) fn write_response(
    w: &mut impl Write,
    resp: &Response,
    close: bool,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(&resp.body).expect("a JSON value serializes");
    let mut head = format!(
        "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: {}\r\n",
        resp.status,
        reason(resp.status),
        body.len(),
        if close { "close" } else { "keep-alive" }
    );
    for (k, v) in &resp.headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    head.push_str("\r\n");
    w.write_all(head.as_bytes())?;
    w.write_all(&body)?;
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    fn read(bytes: &str) -> Result<Option<Request>, Error> {
        read_request(&mut Cursor::new(bytes.as_bytes().to_vec()), 64)
    }

    #[test]
    fn a_request_with_a_body_and_the_next_one_on_the_same_connection() {
        let mut c = Cursor::new(
            b"POST /v1/x?a=1 HTTP/1.1\r\nHost: h\r\ncontent-length: 7\r\n\r\n{\"a\":1}GET /health HTTP/1.1\r\n\r\n"
                .to_vec(),
        );
        let r = read_request(&mut c, 64).unwrap().unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/x"));
        assert_eq!(r.header("Content-Length"), Some("7"));
        assert_eq!(r.json().unwrap(), json!({"a": 1}));
        assert!(!r.close);
        let r = read_request(&mut c, 64).unwrap().unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("GET", "/health"));
        assert!(r.body.is_empty());
        assert!(read_request(&mut c, 64).unwrap().is_none());
    }

    #[test]
    fn malformed_requests_get_their_status() {
        let status = |s: &str| read(s).unwrap_err().status;
        assert_eq!(status("GARBAGE\r\n\r\n"), 400);
        assert_eq!(status("get / HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(status("GET nopath HTTP/1.1\r\n\r\n"), 400);
        assert_eq!(status("GET / HTTP/2\r\n\r\n"), 505);
        assert_eq!(status("GET / HTTP/1.1\r\nno colon\r\n\r\n"), 400);
        assert_eq!(status("POST / HTTP/1.1\r\n\r\n"), 411);
        assert_eq!(status("POST / HTTP/1.1\r\nContent-Length: x\r\n\r\n"), 400);
        assert_eq!(status("POST / HTTP/1.1\r\nContent-Length: 65\r\n\r\n"), 413);
        assert_eq!(
            status("POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab"),
            400
        );
        assert_eq!(
            status("POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"),
            501
        );
        assert_eq!(status("GET / HTTP/1.1\r\nHost: x"), 400);
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(MAX_HEAD));
        assert_eq!(status(&long), 431);
        let many: String = (0..=MAX_HEADERS).map(|i| format!("h{i}: v\r\n")).collect();
        assert_eq!(status(&format!("GET / HTTP/1.1\r\n{many}\r\n")), 431);
        let r = read("POST / HTTP/1.1\r\nContent-Length: 3\r\n\r\n{x}")
            .unwrap()
            .unwrap();
        assert_eq!(r.json().unwrap_err().status, 400);
    }

    /// An idle connection's read timeout ends it quietly; one inside a request is a 400.
    #[test]
    fn a_timeout_before_a_request_closes_quietly() {
        struct Stalls(&'static [u8]);
        impl std::io::Read for Stalls {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.0.is_empty() {
                    return Err(std::io::ErrorKind::TimedOut.into());
                }
                let n = self.0.len().min(buf.len());
                buf[..n].copy_from_slice(&self.0[..n]);
                self.0 = &self.0[n..];
                Ok(n)
            }
        }
        let mut idle = std::io::BufReader::new(Stalls(b""));
        assert!(read_request(&mut idle, 64).unwrap().is_none());
        let mut half = std::io::BufReader::new(Stalls(b"GET / HT"));
        assert_eq!(read_request(&mut half, 64).unwrap_err().status, 400);
    }

    #[test]
    fn http10_and_connection_close_end_the_connection() {
        assert!(read("GET / HTTP/1.0\r\n\r\n").unwrap().unwrap().close);
        assert!(
            !read("GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n")
                .unwrap()
                .unwrap()
                .close
        );
        assert!(
            read("GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
                .unwrap()
                .unwrap()
                .close
        );
    }

    #[test]
    fn errors_are_written_in_the_openai_shape() {
        let mut out = Vec::new();
        let resp: Response = Error::new(401, "no key").into();
        write_response(&mut out, &resp, true).unwrap();
        let text = String::from_utf8(out).unwrap();
        let (head, body) = text.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 401 Unauthorized\r\n"), "{head}");
        assert!(head.contains("Connection: close") && head.contains("WWW-Authenticate: Bearer"));
        assert!(head.contains(&format!("Content-Length: {}", body.len())));
        let v: Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["error"]["message"], "no key");
        assert_eq!(v["error"]["type"], "authentication_error");
    }
}
