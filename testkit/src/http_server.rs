//! The one hand-written HTTP/1.1 server of the tree, for in-process fakes: it accepts on
//! `127.0.0.1:0`, reads each request's head and `content-length` body, and hands the request
//! with its socket to a handler task, which writes the answer and closes the connection (no
//! keep-alive, no chunked request bodies). Used by the tests' [`crate::fake_model`] and by
//! `agentq bench`'s latency-only model provider, which is measured: nothing here waits or
//! copies more than reading the request needs.

use std::future::Future;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// One request as read: its method (upper case) and its body.
#[derive(Debug, Default)]
pub struct Request {
    /// `GET`, `POST`, …; empty when the client closed before sending a head.
    pub method: String,
    /// The `content-length` bytes after the head (fewer if the client closed early).
    pub body: Vec<u8>,
}

/// A running server: accepts until dropped.
pub struct Server {
    /// The address it listens on.
    pub addr: SocketAddr,
    /// `http://ADDR`.
    pub url: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    /// Listens on a free loopback port; every connection's request is read and given to
    /// `handle` in a task of its own, with the socket to answer on (an I/O error ends the
    /// connection quietly).
    pub async fn start<H, F>(handle: H) -> std::io::Result<Self>
    where
        H: Fn(TcpStream, Request) -> F + Send + Sync + 'static,
        F: Future<Output = std::io::Result<()>> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let handle = std::sync::Arc::new(handle);
        let task = tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let handle = handle.clone();
                tokio::spawn(async move {
                    if let Ok(request) = read_request(&mut socket).await {
                        let _ = handle(socket, request).await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            url: format!("http://{addr}"),
            task,
        })
    }
}

/// Reads one request: the head up to the blank line, then `content-length` bytes of body.
pub async fn read_request(socket: &mut TcpStream) -> std::io::Result<Request> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = socket.read(&mut chunk).await?;
        if n == 0 {
            return Ok(Request::default());
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
            let len = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse::<usize>().ok())
                .unwrap_or(0);
            while buf.len() < end + 4 + len {
                let n = socket.read(&mut chunk).await?;
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let method = head.split(' ').next().unwrap_or_default().to_uppercase();
            return Ok(Request {
                method,
                body: buf[end + 4..].to_vec(),
            });
        }
    }
}

/// A whole answer that closes the connection: status line, `content-type`, `content-length`,
/// `extra` headers, then `body`.
pub fn response(status: u16, content_type: &str, extra: &[(String, String)], body: &str) -> String {
    let reason = if status < 400 { "OK" } else { "Error" };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (k, v) in extra {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    format!("{head}\r\n{body}")
}

/// Writes `response(status, content_type, extra, body)` and closes the connection.
pub async fn answer(
    socket: &mut TcpStream,
    status: u16,
    content_type: &str,
    extra: &[(String, String)],
    body: &str,
) -> std::io::Result<()> {
    socket
        .write_all(response(status, content_type, extra, body).as_bytes())
        .await?;
    socket.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn reads_a_request_in_pieces_and_answers_it() {
        let server = Server::start(|mut socket, request: Request| async move {
            let text = format!(
                "{} {}",
                request.method,
                String::from_utf8_lossy(&request.body)
            );
            answer(
                &mut socket,
                200,
                "text/plain",
                &[("x-a".into(), "b".into())],
                &text,
            )
            .await
        })
        .await
        .unwrap();
        let mut client = TcpStream::connect(server.addr).await.unwrap();
        client
            .write_all(b"post / HTTP/1.1\r\nContent-Length: 11\r\n\r\nhello")
            .await
            .unwrap();
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        client.write_all(b" world").await.unwrap();
        let mut got = String::new();
        client.read_to_string(&mut got).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 200 OK\r\n"), "{got}");
        assert!(got.contains("\r\ncontent-length: 16\r\n") && got.contains("\r\nx-a: b\r\n"));
        assert!(got.ends_with("\r\n\r\nPOST hello world"), "{got}");
    }
}
