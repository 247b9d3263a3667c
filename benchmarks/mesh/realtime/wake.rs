use std::sync::mpsc;
use std::time::{Duration, Instant};
use std::net::UdpSocket;
fn pct(v: &mut Vec<u64>, name: &str) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q) as usize];
    println!("{name}: n={} p50={}us p90={}us p99={}us max={}us", v.len(), p(0.5), p(0.9), p(0.99), v[v.len()-1]);
}
fn main() {
    // thread wake via channel, sender sleeps random 1-10ms between sends (receiver parked)
    let (tx, rx) = mpsc::channel::<Instant>();
    let h = std::thread::spawn(move || {
        let mut v = Vec::new();
        while let Ok(t) = rx.recv() { v.push(t.elapsed().as_micros() as u64); }
        v
    });
    let mut x: u64 = 12345;
    for _ in 0..2000 {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        std::thread::sleep(Duration::from_micros(1000 + x % 9000));
        tx.send(Instant::now()).unwrap();
    }
    drop(tx);
    let mut v = h.join().unwrap();
    pct(&mut v, "thread wake (channel)");
    // UDP loopback one way, receiver blocked in recv
    let a = UdpSocket::bind("127.0.0.1:0").unwrap();
    let b = UdpSocket::bind("127.0.0.1:0").unwrap();
    let baddr = b.local_addr().unwrap();
    let t0 = Instant::now();
    let h = std::thread::spawn(move || {
        let mut v = Vec::new(); let mut buf = [0u8; 64];
        for _ in 0..2000 { let n = b.recv(&mut buf).unwrap(); let s = u64::from_le_bytes(buf[..8].try_into().unwrap()); let _ = n; v.push(t0.elapsed().as_micros() as u64 - s); }
        v
    });
    for _ in 0..2000 {
        x ^= x << 13; x ^= x >> 7; x ^= x << 17;
        std::thread::sleep(Duration::from_micros(1000 + x % 9000));
        let s = t0.elapsed().as_micros() as u64;
        a.send_to(&s.to_le_bytes(), baddr).unwrap();
    }
    let mut v = h.join().unwrap();
    pct(&mut v, "udp loopback (blocked recv)");
}
