//! The pipe pool seen through [`proxy_core::pipe::stats`]: a connection that moves only a few
//! bytes never takes a pipe, streaming ones borrow pooled pipes and give them back, and a pipe
//! still holding bytes when its relay is cancelled is closed, never pooled.
//!
//! The pool is process-wide, so everything runs in one test, in order, in this test binary.
#![cfg(target_os = "linux")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use proxy_core::copy::CopyMode;
use proxy_core::pipe;
use proxy_core::relay::{Ending, RelayConfig, Route};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn config() -> RelayConfig {
    RelayConfig::default()
        .with_copy_mode(CopyMode::Splice)
        .with_pipe_size(64 * 1024)
        .with_connect_timeout(Duration::from_secs(5))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipes_are_lent_only_to_streaming_copies_and_only_empty_ones_come_back() {
    let echo = echo_server().await;

    // 1. A chatty but small exchange never takes a pipe, whatever its copy mode.
    let mut relay = relay_once(Route::new("small", echo.addr), config()).await;
    for _ in 0..20 {
        relay.client.write_all(&[7u8; 300]).await.unwrap();
        let mut back = [0u8; 300];
        relay.client.read_exact(&mut back).await.unwrap();
        assert_eq!(back, [7u8; 300]);
    }
    let stats = pipe::stats();
    assert_eq!(stats.created, 0, "a few bytes took a pipe: {stats:?}");
    assert_eq!(stats.in_use, 0, "{stats:?}");
    relay.client.shutdown().await.unwrap();
    let mut rest = Vec::new();
    relay.client.read_to_end(&mut rest).await.unwrap();
    let summary = relay.task.await.unwrap().unwrap();
    assert_eq!(summary.ending, Ending::Completed);
    assert_eq!(summary.to_upstream, 6000);
    assert_eq!(pipe::stats().created, 0);

    // 2. A bulk echo streams through pipes, which all come back to the pool, empty.
    let payload = Arc::new(random_payload(8 << 20));
    let relay = relay_once(Route::new("bulk", echo.addr), config()).await;
    let echoed = echo_roundtrip(relay.client, Arc::clone(&payload), None)
        .await
        .unwrap();
    assert_eq!(echoed, Checksum::of(&payload));
    relay.task.await.unwrap().unwrap();
    let after_bulk = pipe::stats();
    assert!(
        after_bulk.created >= 1,
        "bulk never spliced: {after_bulk:?}"
    );
    assert!(
        after_bulk.created <= 2,
        "one pipe per direction at most: {after_bulk:?}"
    );
    assert_eq!(after_bulk.in_use, 0, "{after_bulk:?}");
    assert_eq!(after_bulk.idle as u64, after_bulk.created, "{after_bulk:?}");

    // 3. The next bulk connection takes the idle pipes before opening new ones. Whether the
    // echo's return direction streams (fills a 16 KiB read) depends on timing, so a run may
    // lend one or two pipes; only the directions the pool could not serve may open one. A pool
    // that never reuses would open one per take, many per 8 MiB echo.
    let relay = relay_once(Route::new("bulk", echo.addr), config()).await;
    let echoed = echo_roundtrip(relay.client, Arc::clone(&payload), None)
        .await
        .unwrap();
    assert_eq!(echoed, Checksum::of(&payload));
    relay.task.await.unwrap().unwrap();
    let reused = pipe::stats();
    let opened = reused.created - after_bulk.created;
    assert!(
        opened <= 2 - after_bulk.idle as u64,
        "{opened} new pipes with {} idle ones to take: {reused:?}",
        after_bulk.idle
    );
    assert_eq!(reused.in_use, 0);
    assert_eq!(reused.idle as u64, reused.created, "{reused:?}");

    // 4. An upstream that stops reading leaves bytes in the pipe; cancelling the relay then
    // closes that pipe rather than giving it back.
    let stalled = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let stalled_addr = stalled.local_addr().unwrap();
    let holder = tokio::spawn(async move {
        let (conn, _) = stalled.accept().await.unwrap();
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(conn);
    });
    let mut relay = relay_once(Route::new("stalled", stalled_addr), config()).await;
    let written = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let writer = tokio::spawn({
        let written = Arc::clone(&written);
        async move {
            let chunk = vec![1u8; 64 * 1024];
            // Fills the upstream's receive buffer, the relay's send buffer, then the pipe; stops
            // once the client's own send buffer is full too.
            while relay.client.write_all(&chunk).await.is_ok() {
                written.fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    eventually(
        Duration::from_secs(30),
        "a pipe lent to the stalled copy",
        || pipe::stats().in_use == 1,
    )
    .await;
    // The copy has filled the pipe and blocked on the upstream once the client cannot write
    // any more: no progress for a whole second (a slow machine only takes longer to get there).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (mut last, mut still) = (u64::MAX, 0);
    while still < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the client never stopped writing into the stalled relay"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
        let now = written.load(std::sync::atomic::Ordering::Relaxed);
        still = if now == last && now > 0 { still + 1 } else { 0 };
        last = now;
    }
    let before_cancel = pipe::stats();
    assert_eq!(before_cancel.in_use, 1, "{before_cancel:?}");
    relay.cancel.cancel();
    let summary = relay.task.await.unwrap().unwrap();
    assert_eq!(summary.ending, Ending::Cancelled);
    let after_cancel = pipe::stats();
    assert_eq!(after_cancel.in_use, 0, "{after_cancel:?}");
    assert_eq!(
        after_cancel.idle, before_cancel.idle,
        "a pipe holding bytes went back to the pool: {after_cancel:?}"
    );
    assert!(
        after_cancel.allocated_bytes < before_cancel.allocated_bytes,
        "the pipe holding bytes was not closed: {before_cancel:?} -> {after_cancel:?}"
    );
    writer.abort();
    holder.abort();
}
