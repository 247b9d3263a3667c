//! The lab on this machine (needs root, iproute2, nftables, iptables and python3, as the
//! chaos suite does): a partition rule really drops a router's packets, loss leaves some
//! through, a delay holds every datagram and releases it, heal restores them, and the
//! namespaces, links and delay agents are gone after the lab is dropped — also when the scope
//! holding it panics. The tests share the runner's pid in their names: they run one at a time.

use kvmesh_chaos::lab::{Lab, resources_of};
use std::process::Command;
use std::sync::Mutex;
use std::time::Duration;

static ONE_LAB_AT_A_TIME: Mutex<()> = Mutex::new(());

fn lab(routers: usize, tag: &str) -> TestLab {
    let dir = std::env::temp_dir().join(format!("kvmesh-chaos-lab-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    TestLab(Some(
        Lab::new(routers, dir, "/bin/false".into())
            .expect("the lab needs root, iproute2, nftables"),
    ))
}

/// A lab whose directory (its rule files) goes when it does.
struct TestLab(Option<Lab>);

impl std::ops::Deref for TestLab {
    type Target = Lab;
    fn deref(&self) -> &Lab {
        self.0.as_ref().expect("held until dropped")
    }
}

impl Drop for TestLab {
    fn drop(&mut self) {
        if let Some(lab) = self.0.take() {
            let dir = lab.dir.clone();
            drop(lab);
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// How many of `n` UDP datagrams router 0 gets through to router 1.
fn delivered(lab: &Lab, n: u32) -> u32 {
    delivered_then(lab, n, || {})
}

/// [`delivered`], with `then` run once the datagrams are sent (the receiver gives up after
/// 1.5 s without one).
fn delivered_then(lab: &Lab, n: u32, then: impl FnOnce()) -> u32 {
    let (to, ns0, ns1) = (lab.router_ip(1), lab.ns(0), lab.ns(1));
    let recv = format!(
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('{to}',9999))\n\
         s.settimeout(1.5)\nc=0\nprint('ready',flush=True)\ntry:\n    while True:\n        s.recv(64); c+=1\n\
         except OSError:\n    pass\nprint(c)"
    );
    let mut rx = Command::new("ip")
        .args(["netns", "exec", &ns1, "python3", "-c", &recv])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = rx.stdout.take().unwrap();
    let mut first = [0u8; 6];
    std::io::Read::read_exact(&mut out, &mut first).unwrap();
    let send = format!(
        "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\n\
         for i in range({n}):\n    s.sendto(b'x',('{to}',9999)); time.sleep(0.002)"
    );
    let st = Command::new("ip")
        .args(["netns", "exec", &ns0, "python3", "-c", &send])
        .status()
        .unwrap();
    assert!(st.success());
    then();
    let mut rest = String::new();
    std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
    rx.wait().unwrap();
    rest.trim().parse().unwrap()
}

/// Median round trip of 20 UDP pings from router 0 to an echo in router 1, in ms (recorded,
/// not asserted: the project allows no timed assertions).
fn rtt_ms(lab: &Lab) -> f64 {
    let (to, ns0, ns1) = (lab.router_ip(1), lab.ns(0), lab.ns(1));
    let echo = format!(
        "import socket\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.bind(('{to}',9998))\n\
         s.settimeout(3)\nprint('ready',flush=True)\ntry:\n    while True:\n        d,a=s.recvfrom(64); s.sendto(d,a)\n\
         except OSError:\n    pass"
    );
    let mut rx = Command::new("ip")
        .args(["netns", "exec", &ns1, "python3", "-c", &echo])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = rx.stdout.take().unwrap();
    let mut first = [0u8; 6];
    std::io::Read::read_exact(&mut out, &mut first).unwrap();
    let ping = format!(
        "import socket,time\ns=socket.socket(socket.AF_INET,socket.SOCK_DGRAM)\ns.settimeout(2)\nr=[]\n\
         for i in range(20):\n    t=time.monotonic(); s.sendto(b'p',('{to}',9998)); s.recv(64); r.append(time.monotonic()-t)\n\
         r.sort()\nprint(r[10]*1000)"
    );
    let o = Command::new("ip")
        .args(["netns", "exec", &ns0, "python3", "-c", &ping])
        .output()
        .unwrap();
    rx.kill().unwrap();
    rx.wait().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).trim().parse().unwrap()
}

#[test]
fn partitions_drop_real_packets_loss_drops_some_and_the_lab_leaves_nothing() {
    let _one = ONE_LAB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    let l = lab(2, "rules");
    assert!(resources_of(pid).len() >= 6, "{:?}", resources_of(pid));
    assert_eq!(delivered(&l, 200), 200);
    // Router 1 drops what comes from router 0 (rules sit on the receiving side).
    l.set_rules(1, &[0], &[], 0).unwrap();
    assert_eq!(delivered(&l, 200), 0);
    l.set_rules(1, &[], &[0], 50).unwrap();
    let some = delivered(&l, 400);
    assert!(
        (100..300).contains(&some),
        "{some} of 400 through at 50% loss"
    );
    l.heal().unwrap();
    assert_eq!(delivered(&l, 200), 200);
    let dir = l.dir.clone();
    drop(l);
    assert_eq!(resources_of(pid), Vec::<String>::new());
    assert!(!dir.exists(), "{} left", dir.display());

    // A panic while the lab is up: unwinding tears it down.
    let r = std::panic::catch_unwind(|| {
        let _l = lab(1, "panic");
        panic!("a scenario failed");
    });
    assert!(r.is_err());
    assert_eq!(resources_of(pid), Vec::<String>::new());
}

#[test]
fn a_delay_holds_every_datagram_then_releases_it_and_heal_removes_its_rule_and_agent() {
    let _one = ONE_LAB_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let pid = std::process::id();
    let l = lab(2, "delay");
    let plain = rtt_ms(&l);
    // Router 1 holds what comes from router 0 for 100 ms (the receiving side, as loss).
    l.set_delay(1, &[0], Duration::from_millis(100), Duration::ZERO)
        .unwrap();
    let agents = resources_of(pid);
    assert!(
        agents.iter().any(|r| r == "1 delay agent(s) running"),
        "{agents:?}"
    );
    let rule = Command::new("ip")
        .args(["netns", "exec", &l.ns(1), "iptables", "-S", "INPUT"])
        .output()
        .unwrap();
    let rule = String::from_utf8_lossy(&rule.stdout);
    assert!(
        rule.contains(&format!("-s {}/32", l.router_ip(0)))
            && rule.contains("--queue-num 7946 --queue-bypass"),
        "{rule}"
    );
    // Every datagram arrives, and each went through the agent: held, then released.
    assert_eq!(delivered(&l, 200), 200);
    let c = l.delay_counts();
    assert_eq!(c.len(), 1);
    let (r, c) = c[0];
    assert_eq!(r, 1);
    assert_eq!((c.held, c.released), (200, 200), "{c}");
    assert_eq!((c.overflow, c.missed, c.errors), (0, 0, 0), "{c}");
    // The pings are held too (one way: 100 ms more per round trip).
    let delayed = rtt_ms(&l);
    let c = l.delay_counts()[0].1;
    assert_eq!((c.held, c.released), (220, 220), "{c}");
    eprintln!(
        "median UDP round trip r0→r1→r0: {plain:.3} ms plain, {delayed:.3} ms with a 100 ms delay on r1's input"
    );
    // A delay from router 1 too, then replaced by none on router 0: each router its own.
    l.set_delay(0, &[1], Duration::from_millis(5), Duration::from_millis(5))
        .unwrap();
    assert_eq!(l.delay_counts().len(), 2);
    l.set_delay(0, &[], Duration::ZERO, Duration::ZERO).unwrap();
    assert_eq!(l.delay_counts().len(), 1);
    l.heal().unwrap();
    assert!(l.delay_counts().is_empty());
    let stopped = l.take_stopped_delays();
    assert_eq!(stopped.len(), 2, "{stopped:?}");
    assert!(stopped.iter().all(|(_, c)| c.errors == 0), "{stopped:?}");
    let rule = Command::new("ip")
        .args(["netns", "exec", &l.ns(1), "iptables", "-S", "INPUT"])
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&rule.stdout).contains("NFQUEUE"));
    assert_eq!(delivered(&l, 200), 200);
    assert!(!resources_of(pid).iter().any(|r| r.contains("delay agent")));

    // Healed while packets are held for 2 s: the receiver, which gives up after 1.5 s
    // without a datagram, gets every one — heal releases them at once, drops none.
    l.set_delay(1, &[0], Duration::from_millis(2000), Duration::ZERO)
        .unwrap();
    assert_eq!(delivered_then(&l, 50, || l.heal().unwrap()), 50);
    let stopped = l.take_stopped_delays();
    assert_eq!(stopped.len(), 1);
    let c = stopped[0].1;
    assert_eq!((c.held, c.released, c.errors), (50, 50, 0), "{c}");

    // Dropped with a delay in force: agent and namespaces go.
    l.set_delay(1, &[0], Duration::from_millis(100), Duration::ZERO)
        .unwrap();
    drop(l);
    assert_eq!(resources_of(pid), Vec::<String>::new());
}
