//! A real `redis-server` for tests and benchmarks of gateways that share state: started
//! on a free loopback port with persistence off, killed (SIGKILL) when dropped.
//!
//! Not a mock: the point of those tests is the real server's behaviour (Lua, pub/sub,
//! dropped connections when it dies). When the binary is missing, [`RedisServer::start`]
//! says so with `Ok(None)` so a test can skip loudly instead of failing obscurely;
//! `./test.sh` installs it.

use std::net::{Ipv4Addr, SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::Context;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A `redis-server` process on `127.0.0.1:port`.
pub struct RedisServer {
    bin: PathBuf,
    port: u16,
    child: Option<Child>,
}

/// `redis-server` from `REDIS_SERVER`, or the first one on `PATH`.
pub fn redis_server_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("REDIS_SERVER") {
        return Some(PathBuf::from(p));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("redis-server"))
        .find(|p| p.is_file())
}

/// A loopback port nothing listens on right now.
pub fn free_port() -> anyhow::Result<u16> {
    let l = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0)))?;
    Ok(l.local_addr()?.port())
}

impl RedisServer {
    /// Starts a server on a free port and waits until it answers `PING`. `Ok(None)` when
    /// no `redis-server` binary is installed.
    pub async fn start() -> anyhow::Result<Option<RedisServer>> {
        let Some(mut s) = Self::unstarted()? else {
            return Ok(None);
        };
        // The port was free when picked, and something else may bind it before the
        // server does: then another free port, as no one has this server's address yet.
        for _ in 0..2 {
            if s.restart().await.is_ok() {
                return Ok(Some(s));
            }
            s.port = free_port()?;
        }
        s.restart().await?;
        Ok(Some(s))
    }

    /// A handle for a server on a free port that is not started yet (a gateway can be
    /// pointed at it before it exists). `Ok(None)` without the binary.
    pub fn unstarted() -> anyhow::Result<Option<RedisServer>> {
        let Some(bin) = redis_server_binary() else {
            return Ok(None);
        };
        Ok(Some(RedisServer {
            bin,
            port: free_port()?,
            child: None,
        }))
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `redis://127.0.0.1:{port}`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Whether the process is running (started and not killed).
    pub fn running(&self) -> bool {
        self.child.is_some()
    }

    /// Kills the server at once (SIGKILL: no shutdown, connections just drop) and waits
    /// for the process to end.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the process (SIGSTOP) without closing its connections: a Redis that has
    /// stopped answering. [`RedisServer::resume`] lets it go on.
    pub fn pause(&self) -> anyhow::Result<()> {
        self.signal("-STOP")
    }

    pub fn resume(&self) -> anyhow::Result<()> {
        self.signal("-CONT")
    }

    fn signal(&self, sig: &str) -> anyhow::Result<()> {
        let pid = self
            .child
            .as_ref()
            .map(Child::id)
            .context("redis-server is not running")?;
        let status = Command::new("kill")
            .args([sig, &pid.to_string()])
            .status()
            .context("running kill")?;
        anyhow::ensure!(status.success(), "kill {sig} {pid} failed");
        Ok(())
    }

    /// (Re)starts the server on the same port, empty, and waits until it answers.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.kill();
        let child = Command::new(&self.bin)
            .args(["--port", &self.port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .args(["--loglevel", "warning"])
            .arg("--dir")
            .arg(std::env::temp_dir())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| format!("starting {}", self.bin.display()))?;
        let pid = child.id();
        self.child = Some(child);
        for _ in 0..200 {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                anyhow::bail!(
                    "redis-server on port {} exited as it started ({status}): is the port taken?",
                    self.port
                );
            }
            // The server answering must be this one: another process may hold the port.
            if self.process_id().await == Some(pid) {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        self.kill();
        anyhow::bail!(
            "redis-server on port {} did not answer within 5 s",
            self.port
        )
    }

    /// The `process_id` the server on the port gives in `INFO server`.
    async fn process_id(&self) -> Option<u32> {
        let info = self.command(&["INFO", "server"]).await.ok()?;
        info.lines()
            .find_map(|l| l.strip_prefix("process_id:"))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Whether the server answers `PING` now.
    pub async fn ping(&self) -> bool {
        matches!(self.command(&["PING"]).await, Ok(r) if r.starts_with("+PONG"))
    }

    /// Sends one command (inline arguments without spaces or quoting needs) and returns
    /// the raw reply's first read: enough for tests to poke at keys without a client.
    pub async fn command(&self, args: &[&str]) -> anyhow::Result<String> {
        let mut req = format!("*{}\r\n", args.len());
        for a in args {
            req.push_str(&format!("${}\r\n{a}\r\n", a.len()));
        }
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let fut = async {
            let mut s = tokio::net::TcpStream::connect(addr).await?;
            s.write_all(req.as_bytes()).await?;
            let mut buf = vec![0u8; 64 * 1024];
            let n = s.read(&mut buf).await?;
            buf.truncate(n);
            anyhow::Ok(String::from_utf8_lossy(&buf).into_owned())
        };
        tokio::time::timeout(Duration::from_secs(2), fut)
            .await
            .context("no answer from redis-server")?
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        // A stopped process still dies of SIGKILL.
        self.kill();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_port_something_else_holds_is_an_error_not_that_other_server() {
        let Some(mut other) = RedisServer::start().await.unwrap() else {
            eprintln!("SKIPPED: no redis-server binary");
            return;
        };
        // Another redis-server on the port: it answers PING, but it is not this one.
        let mut clash = RedisServer {
            bin: other.bin.clone(),
            port: other.port(),
            child: None,
        };
        let err = clash.restart().await.unwrap_err().to_string();
        assert!(err.contains(&format!("port {}", other.port())), "{err}");
        assert!(!clash.running());
        assert!(other.ping().await, "the other server is untouched");
        // A listener that answers nothing: the server's exit is what is reported (at
        // once), not the 5 s without an answer.
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).unwrap();
        clash.port = listener.local_addr().unwrap().port();
        let err = clash.restart().await.unwrap_err().to_string();
        assert!(err.contains("exited as it started"), "{err}");
        other.kill();
    }
}
