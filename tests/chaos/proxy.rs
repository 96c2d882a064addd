//! A TCP fault proxy: listens on `127.0.0.1:0`, forwards every connection to one target, and
//! on command resets all connections, blackholes, delays, or cuts the next server chunk
//! mid-frame. agentq processes are pointed at it (`DATABASE_URL` / `AMQP_URL` with its port),
//! so a fault hits exactly the connections a real network fault would.
//!
//! A blackhole drops every byte of every connection, in both directions, for its duration
//! (calls in flight hang, new connections hang); when it ends, the connections that lost bytes
//! are reset, as TCP would once a partition heals and a peer that gave the connection up
//! answers with RST. Connections opened afterwards work normally.
//!
//! A silent fault is a blackhole that never heals the connections it hit: every connection open
//! when it starts, and every one opened while it lasts, drops every byte from then on and is
//! never reset or closed by the proxy (a wedged pooler, a NAT that forgot the flow, a partition
//! whose peers never answer). Only the client can end them, by noticing the silence. Connections
//! opened after it ends work normally.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// The commands a test gives the proxy, shared with its connection tasks.
struct Faults {
    /// Bumped by [`Proxy::reset_all`]; every connection alive at that moment is reset.
    reset: watch::Sender<u64>,
    /// Bumped when a blackhole ends; the connections it hit are reset.
    healed: watch::Sender<u64>,
    blackhole: AtomicBool,
    /// Bumped when a silent fault starts: every connection alive then goes silent for good.
    silenced: watch::Sender<u64>,
    /// A silent fault is on: new connections are silent for good too.
    silent: AtomicBool,
    delay_ms: AtomicU64,
    /// Non-zero: the next chunk from the server is forwarded only up to this many bytes, then
    /// the connection is reset.
    cut_after: AtomicUsize,
    /// Connections accepted so far (for the report).
    accepted: AtomicU64,
}

/// A running proxy; dropping it stops accepting and resets every connection.
pub struct Proxy {
    pub addr: SocketAddr,
    faults: Arc<Faults>,
    stop: CancellationToken,
}

impl Proxy {
    /// Starts a proxy to `target`.
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("binding the proxy");
        let addr = listener.local_addr().unwrap();
        let faults = Arc::new(Faults {
            reset: watch::channel(0).0,
            healed: watch::channel(0).0,
            blackhole: AtomicBool::new(false),
            silenced: watch::channel(0).0,
            silent: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            cut_after: AtomicUsize::new(0),
            accepted: AtomicU64::new(0),
        });
        let stop = CancellationToken::new();
        let (f, s) = (faults.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let (client, _) = tokio::select! {
                    _ = s.cancelled() => return,
                    a = listener.accept() => match a {
                        Ok(a) => a,
                        Err(_) => continue,
                    },
                };
                f.accepted.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(relay(client, target, f.clone(), s.child_token()));
            }
        });
        Self { addr, faults, stop }
    }

    /// Resets (RST) every open connection; new ones are accepted as usual.
    pub fn reset_all(&self) {
        self.faults.reset.send_modify(|g| *g += 1);
    }

    /// Starts or ends a blackhole (see the module doc for what happens to its connections).
    pub fn blackhole(&self, on: bool) {
        self.faults.blackhole.store(on, Ordering::SeqCst);
        if !on {
            self.faults.healed.send_modify(|g| *g += 1);
        }
    }

    /// Starts or ends a silent fault (see the module doc).
    pub fn silent(&self, on: bool) {
        self.faults.silent.store(on, Ordering::SeqCst);
        if on {
            self.faults.silenced.send_modify(|g| *g += 1);
        }
    }

    /// Delays every chunk, in both directions, by `delay` (zero ends it).
    pub fn delay(&self, delay: Duration) {
        self.faults
            .delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Forwards only the first `bytes` of the next chunk the server sends, then resets that
    /// connection: the client sees a frame cut in the middle.
    pub fn cut_mid_frame(&self, bytes: usize) {
        self.faults.cut_after.store(bytes.max(1), Ordering::SeqCst);
    }

    /// Whether a cut is still waiting for its chunk.
    pub fn cut_pending(&self) -> bool {
        self.faults.cut_after.load(Ordering::SeqCst) != 0
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> u64 {
        self.faults.accepted.load(Ordering::Relaxed)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// One client connection: connect to the target and pump both ways until either side closes,
/// a reset, a cut, or the proxy stops.
async fn relay(
    client: TcpStream,
    target: SocketAddr,
    faults: Arc<Faults>,
    stop: CancellationToken,
) {
    let forever = faults.silent.load(Ordering::SeqCst);
    let dead = Arc::new(AtomicBool::new(
        forever || faults.blackhole.load(Ordering::SeqCst),
    ));
    let server = if dead.load(Ordering::SeqCst) {
        None
    } else {
        TcpStream::connect(target).await.ok()
    };
    let server = match server {
        Some(s) => s,
        // Blackholed from the start: keep the client hanging, reading and dropping, as a
        // partition would, until it gives up or the proxy stops (or, for a blackhole, it heals).
        None if dead.load(Ordering::SeqCst) => {
            hold_blackholed(client, faults, stop, forever).await;
            return;
        }
        // The target is down (restarting): the client is refused, as it would be directly.
        None => {
            let _ = client.set_zero_linger();
            return;
        }
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let conn = stop.child_token();
    let up = pump(cr, sw, false, faults.clone(), dead.clone(), conn.clone());
    let down = pump(sr, cw, true, faults, dead, conn.clone());
    // A reset or cut ends both directions; then both sockets are closed with an RST.
    if let (Some((cr, sw)), Some((sr, cw))) = tokio::join!(up, down) {
        abort(cr, cw);
        abort(sr, sw);
    }
}

/// Closes a connection with an RST rather than a FIN.
fn abort(read: OwnedReadHalf, write: OwnedWriteHalf) {
    if let Ok(stream) = read.reunite(write) {
        let _ = stream.set_zero_linger();
    }
}

async fn hold_blackholed(
    mut client: TcpStream,
    faults: Arc<Faults>,
    stop: CancellationToken,
    forever: bool,
) {
    let mut reset = faults.reset.subscribe();
    let mut healed = faults.healed.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = reset.changed() => break,
            _ = healed.changed(), if !forever => break,
            r = client.read(&mut buf) => match r {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            },
        }
    }
    let _ = client.set_zero_linger();
}

/// Copies one direction. Returns the halves when the connection must be reset (the caller
/// reunites them to send an RST), `None` when it ended by a normal close.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    from_server: bool,
    faults: Arc<Faults>,
    dead: Arc<AtomicBool>,
    conn: CancellationToken,
) -> Option<(OwnedReadHalf, OwnedWriteHalf)> {
    let mut reset = faults.reset.subscribe();
    let mut healed = faults.healed.subscribe();
    let mut silenced = faults.silenced.subscribe();
    // Silenced for good: no heal, no reset from the proxy; only the client can end it.
    let mut forever = false;
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = tokio::select! {
            _ = conn.cancelled() => break,
            _ = reset.changed() => break,
            _ = healed.changed(), if dead.load(Ordering::SeqCst) && !forever => break,
            _ = silenced.changed() => {
                forever = true;
                dead.store(true, Ordering::SeqCst);
                continue;
            }
            r = from.read(&mut buf) => match r {
                Ok(0) | Err(_) => {
                    if forever && from_server {
                        // The server gave up on the silent connection (its heartbeat check,
                        // say); the client must not hear of it: it stays silent until the
                        // client ends it.
                        conn.cancelled().await;
                        break;
                    }
                    if dead.load(Ordering::SeqCst) {
                        break;
                    }
                    let _ = to.shutdown().await;
                    return None;
                }
                Ok(n) => n,
            },
        };
        if faults.blackhole.load(Ordering::SeqCst) && !dead.swap(true, Ordering::SeqCst) {
            // Only the end of this blackhole resets it, not one that ended earlier.
            healed.borrow_and_update();
        }
        if dead.load(Ordering::SeqCst) {
            continue;
        }
        let delay = faults.delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::select! {
                _ = conn.cancelled() => break,
                _ = reset.changed() => break,
                _ = tokio::time::sleep(Duration::from_millis(delay)) => {}
            }
        }
        if from_server {
            let cut = faults.cut_after.swap(0, Ordering::SeqCst);
            if cut > 0 {
                let k = cut.min(n.saturating_sub(1)).max(1);
                let _ = to.write_all(&buf[..k]).await;
                break;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    conn.cancel();
    Some((from, to))
}
