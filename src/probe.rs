//! `agentq probe URL`: the health check of a container image that has no shell or curl
//! (`docker-compose.yml`). One `GET` over plain HTTP/1.1 with a deadline; success when the
//! answer's status is 2xx. No runtime, logging or configuration: it runs every few seconds.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use anyhow::{Context, anyhow, bail};

/// GETs `url`; Ok when it answers 2xx within `timeout`, else an error saying what happened.
pub fn run(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let status = status_of(url, timeout).with_context(|| format!("probe {url}"))?;
    if !(200..300).contains(&status) {
        bail!("probe {url}: answered {status}");
    }
    Ok(())
}

/// The status code `url` answers with.
fn status_of(url: &str, timeout: Duration) -> anyhow::Result<u16> {
    let deadline = Instant::now() + timeout;
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow!("only http:// URLs can be probed"))?;
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let path = if path.is_empty() { "/" } else { path };
    if authority.is_empty() || authority.contains('@') {
        bail!("the URL needs a host (and no user)");
    }
    // A port is given unless the authority ends with its host: `host`, `[::1]`.
    let has_port = authority
        .rsplit_once(':')
        .is_some_and(|(_, port)| !port.ends_with(']'));
    let address = if has_port {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let left = || {
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1))
    };
    let mut last = None;
    let mut stream = None;
    for addr in address.to_socket_addrs().context("resolving the host")? {
        match TcpStream::connect_timeout(&addr, left()) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let mut stream = match (stream, last) {
        (Some(s), _) => s,
        (None, Some(e)) => return Err(e).context("connecting"),
        (None, None) => bail!("the host resolves to no address"),
    };
    stream.set_write_timeout(Some(left()))?;
    // One buffer, one write: `write!` on a socket sends each formatted piece on its own.
    let request = format!(
        "GET {path} HTTP/1.1\r\nHost: {authority}\r\nUser-Agent: agentq-probe\r\nConnection: close\r\n\r\n"
    );
    stream
        .write_all(request.as_bytes())
        .context("sending the request")?;
    // Only the status line is read: `HTTP/1.1 200 OK`.
    let mut head = Vec::new();
    let mut buf = [0u8; 256];
    while !head.windows(2).any(|w| w == b"\r\n") && head.len() < 1024 {
        stream.set_read_timeout(Some(left()))?;
        let n = stream.read(&mut buf).context("reading the answer")?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&head);
    let line = line.lines().next().unwrap_or_default();
    match line.split_whitespace().collect::<Vec<_>>()[..] {
        [version, code, ..] if version.starts_with("HTTP/") => code
            .parse()
            .map_err(|_| anyhow!("not an HTTP status line: {line:?}")),
        _ => bail!("not an HTTP answer: {line:?}"),
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;

    use super::*;

    /// A server answering each connection with `answer`, on a free port.
    fn server(answer: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let mut conn = conn.unwrap();
                // The request may arrive in pieces: read up to the blank line ending its head.
                let mut request = Vec::new();
                let mut buf = [0u8; 256];
                while !request.ends_with(b"\r\n\r\n") {
                    let n = conn.read(&mut buf).unwrap();
                    assert!(n > 0, "the probe closed before its request ended");
                    request.extend_from_slice(&buf[..n]);
                }
                assert!(request.starts_with(b"GET /healthz HTTP/1.1\r\n"));
                conn.write_all(answer.as_bytes()).unwrap();
            }
        });
        format!("http://{addr}/healthz")
    }

    #[test]
    fn a_2xx_passes_and_anything_else_fails_saying_why() {
        let t = Duration::from_secs(5);
        run(&server("HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n"), t).unwrap();
        let e = run(&server("HTTP/1.1 503 Service Unavailable\r\n\r\n"), t).unwrap_err();
        assert!(format!("{e:#}").contains("answered 503"), "{e:#}");
        let e = run(&server("hello\r\n"), t).unwrap_err();
        assert!(format!("{e:#}").contains("not an HTTP answer"), "{e:#}");
        // Nothing listens on a port just freed.
        let free = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let e = run(&format!("http://{free}/healthz"), t).unwrap_err();
        assert!(format!("{e:#}").contains("connecting"), "{e:#}");
        for bad in [
            "https://127.0.0.1/healthz",
            "http:///healthz",
            "127.0.0.1:9464",
        ] {
            assert!(run(bad, t).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_silent_server_fails_at_the_deadline() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let started = Instant::now();
        let e = run(
            &format!("http://{addr}/healthz"),
            Duration::from_millis(300),
        )
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(3), "{e:#}");
        drop(listener);
    }
}
